"""Bearer-key authentication, on when `OPENJEV_API_KEY` is set. It runs as ASGI middleware in front
of the body gate, so a request without the key is refused before its body is read or parsed."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from api.middleware import ASGIApp, Receive, Scope, Send, error_body, send_json

PROTECTED_PREFIXES = ("/v1/", "/metrics")
"""The API itself and the metrics; health probes and the documentation pages stay open."""


def is_protected(path: str) -> bool:
    """Whether `path` needs the key when one is set."""
    return path.startswith(PROTECTED_PREFIXES)


class KeyGate:
    """403 without `Authorization: Bearer <key>`, 401 with a wrong key. With no key configured, any
    Authorization header is accepted and ignored (official clients always send one)."""

    def __init__(self, app: ASGIApp, key: SecretStr | None) -> None:
        self.app = app
        self.key = key.get_secret_value().encode() if key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        status, message = self._refusal(dict(scope["headers"]).get(b"authorization", b""))
        if status:
            scope.setdefault("state", {})["error_type"] = "authentication_error"
            await send_json(send, status, error_body("authentication_error", message))
            return
        await self.app(scope, receive, send)

    def _refusal(self, authorization: bytes) -> tuple[int, str]:
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return 403, "missing API key: send `Authorization: Bearer <key>`"
        assert self.key is not None
        if not hmac.compare_digest(token, self.key):
            return 401, "invalid API key"
        return 0, ""
