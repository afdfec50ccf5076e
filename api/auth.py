"""Who is calling, and may they send this now. Two ASGI middlewares in front of the body gate, so a
request without a key, or over its tenant's rate, is refused before its body is read or parsed:
`KeyGate` maps the Bearer key to its tenant (common/tenants.py) and `RateGate` counts a submission
against the tenant's requests per minute, in Redis, so every API replica enforces the same limit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from api.errors import ApiError, error_body, send_json
from api.middleware import ASGIApp, Message, Receive, Scope, Send
from common.tenants import KeysFileError, Tenant, TenantDirectory

log = logging.getLogger("openjev.api")

PROTECTED_PREFIXES = ("/v1/", "/metrics")
"""The API itself and the metrics; health probes and the documentation pages stay open."""
SUBMISSIONS = frozenset({"/v1/systemone", "/v1/jobs"})  # POSTs that count against requests_per_minute
RELOAD_INTERVAL = 1.0  # seconds between looks at the keys file for a change


def is_protected(path: str) -> bool:
    """Whether `path` needs the key when one is set."""
    return path.startswith(PROTECTED_PREFIXES)


def tenant_of(scope: Scope) -> Tenant:
    """The tenant `KeyGate` found for this request."""
    return scope["state"]["tenant"]


def queue_weight(scope: Scope) -> float:
    """The weights of all the tenants that may queue jobs, where the keys file names more than one (0: the queue
    is one tenant's): then the queue's memory is shared out by weight when Redis nears its maxmemory
    (common/queue/placement.py)."""
    return scope["state"].get("queue_weight", 0.0)


class TenantKeys:
    """The tenants in force: from the keys file, re-read when it changes (or on SIGHUP) without a
    restart, or fixed (`OPENJEV_API_KEY`, or none). A changed file that cannot be used is logged and
    the tenants before it stay in force; at startup, it stops the API (KeysFileError)."""

    def __init__(self, directory: TenantDirectory) -> None:
        self.directory = directory
        self._stamp = self._file_stamp()

    @classmethod
    def load(cls, keys_file: Path | None, api_key: str | None) -> TenantKeys:
        if keys_file is not None and api_key is not None:
            raise KeysFileError("set OPENJEV_API_KEYS_FILE or OPENJEV_API_KEY, not both (a single key is the "
                                "keys file's one tenant)")
        if keys_file is not None:
            return cls(TenantDirectory.from_file(keys_file))
        return cls(TenantDirectory.single(api_key))

    def reload_if_changed(self) -> bool:
        """Read the keys file again if it changed since it was last read; True if new tenants took effect."""
        stamp = self._file_stamp()
        if self.directory.source is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        return self.reload()

    def reload(self) -> bool:
        source = self.directory.source
        if source is None:
            return False
        try:
            directory = TenantDirectory.from_file(source)
        except KeysFileError as exc:
            log.error("keys file not reloaded; the tenants before it stay in force: %s", exc)
            return False
        self.directory = directory
        log.info("keys file reloaded: %d tenants (%s)", len(directory.tenants), ", ".join(directory.names))
        return True

    async def watch(self) -> None:
        """Re-read the file whenever it changes, and on SIGHUP, until cancelled. Without a keys file
        there is nothing to re-read: it returns at once, so an API at rest wakes only for work."""
        if self.directory.source is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, self._sighup)
        try:
            while True:
                await asyncio.sleep(RELOAD_INTERVAL)
                self.reload_if_changed()
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGHUP)

    def _sighup(self) -> None:
        self._stamp = self._file_stamp()
        self.reload()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        source = self.directory.source
        if source is None:
            return None
        try:
            st = os.stat(source)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size


class KeyGate:
    """403 without `Authorization: Bearer <key>`, 401 with a key no tenant holds. With no key configured,
    every caller is the one open tenant and any Authorization header is accepted and ignored (official
    clients always send one). /metrics shows every tenant's counters: only an operator tenant reads it."""

    def __init__(self, app: ASGIApp, keys: TenantKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        directory = self.keys.directory
        state = scope.setdefault("state", {})
        state["queue_weight"] = directory.shared_weight
        if directory.open:
            state["tenant"] = next(iter(directory.tenants.values()))
            await self.app(scope, receive, send)
            return
        if not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        status, message, tenant = self._identify(directory, dict(scope["headers"]).get(b"authorization", b""))
        if tenant is not None and scope["path"].startswith("/metrics") and not tenant.operator:
            status, message = 403, "/metrics shows every tenant's figures: it needs an operator tenant's key"
        if status:
            state["error_type"] = "authentication_error"
            await send_json(send, status, error_body("authentication_error", message))
            return
        state["tenant"] = tenant
        await self.app(scope, receive, send)

    @staticmethod
    def _identify(directory: TenantDirectory, authorization: bytes) -> tuple[int, str, Tenant | None]:
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return 403, "missing API key: send `Authorization: Bearer <key>`", None
        tenant = directory.authenticate(token)
        if tenant is None:
            return 401, "invalid API key", None
        return 0, "", tenant


class RateGate:
    """Counts each submission (POST /v1/systemone, POST /v1/jobs) against its tenant's
    `requests_per_minute`; over it: 429 with Retry-After and the RateLimit fields, in the contract's error
    shape, before the body is read. Allowed submissions carry the RateLimit fields too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant: Tenant | None = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        per_minute = tenant.limits.requests_per_minute if tenant is not None else None
        if per_minute is None or scope["method"] != "POST" or scope["path"] not in SUBMISSIONS:
            await self.app(scope, receive, send)
            return
        try:  # a Redis error: the queue's 503, its cause in the log (api/queue_client.py Reachable)
            decision = await scope["app"].state.services.queue.admit(tenant.name, per_minute, tenant.limits.burst)
        except ApiError as down:
            scope["state"]["error_type"] = down.error_type
            await down.send_to(send)
            return
        headers = [(name.lower().encode(), value.encode()) for name, value in decision.headers().items()]
        if not decision.allowed:
            scope["state"]["error_type"] = "rate_limit_error"
            scope["app"].state.metrics.observe_refusal(tenant.name, "requests_per_minute")
            await send_json(send, 429, error_body(
                "rate_limit_error", f"tenant {tenant.name!r} is over its limit of {per_minute} requests per minute; "
                f"retry in {decision.headers()['Retry-After']} s"), headers)
            return

        async def with_rate_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *headers]
            await send(message)

        await self.app(scope, receive, with_rate_headers)
