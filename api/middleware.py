"""ASGI middleware: a request id, a Date and JSON on every response (500s included), and the request
body gate (read timeout, size limit on the decompressed bytes, zstd and gzip bodies, strict JSON)."""

from __future__ import annotations

import asyncio
import io
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from email.parser import BytesParser
from email.policy import HTTP
from email.utils import formatdate
from typing import Any

import orjson
import zstandard
from starlette.routing import compile_path

from api.errors import error_body, send_json
from api.strict_json import PARSED_BODY, BodyRejected, read_json
from common.contract import ASSETS_REFUSED, echo
from common.jobs import new_request_id

log = logging.getLogger("openjev.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-typesafe-request-id"
QUIET_PATHS = frozenset({"/health", "/health/live", "/metrics"})  # probes: no log line per call


class HttpDate:
    """The `Date` header's value (RFC 9110: an origin server with a clock sends one), formatted at most
    once a second, when a response asks for it: the server has no timer of its own (api/server.py)."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self.second:
            self.second, self.value = second, formatdate(second, usegmt=True).encode()
        return self.value


class RequestContext:
    """Gives every request an id, stamps it and the date on every response, and turns an unhandled
    error into a JSON 500 that still carries the id (the official SDK raises on a response without it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.date = HttpDate()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        started = time.perf_counter()
        status = 0

        async def stamped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode()),
                                      (b"date", self.date.now())]
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        except asyncio.CancelledError:
            if not _stopping(scope):
                raise
            # The server stopped waiting for it (uvicorn's graceful-shutdown timeout): an answer the client
            # can act on, rather than a traceback in the log and a bare 500.
            log.info("request cut short: the API is stopping", extra={"request_id": request_id})
            if not status:
                await send_json(stamped, 503, error_body(
                    "unavailable_error", "the API stopped before this request was answered; send it again"),
                    [(b"retry-after", b"1")])
        except Exception:
            log.exception("unhandled error", extra={"request_id": request_id})
            if not status:
                await send_json(stamped, 500, error_body("api_error", "internal error; quote the request id"))
        finally:
            seconds = time.perf_counter() - started
            route = _route_path(scope)
            metrics = getattr(scope["app"].state, "metrics", None) if "app" in scope else None
            if metrics is not None:
                tenant = state.get("tenant")
                metrics.observe_request(route, status or 499, seconds, tenant.name if tenant is not None else None)
            if scope["path"] not in QUIET_PATHS:
                log.info("request", extra={
                    "event": "request", "request_id": request_id, "job_id": state.get("job_id"),
                    "method": scope["method"], "path": scope["path"], "status": status or 499,
                    "duration_ms": round(seconds * 1000, 2),
                    "error_type": state.get("error_type")})


def _stopping(scope: Scope) -> bool:
    stopping = getattr(getattr(scope.get("app"), "state", None), "stopping", None)
    return isinstance(stopping, asyncio.Event) and stopping.is_set()


def _route_path(scope: Scope) -> str:
    """The route template a request was for. A request refused before routing (401/403 by the key gate,
    413/415 by the body gate) is matched here against the schema's paths, as `api.errors.allowed_methods`
    does, so its metrics carry its real route, not "unmatched"."""
    route = scope.get("route")
    if route is not None:
        return str(route.path)
    app = scope.get("app")
    if app is None or not hasattr(app, "openapi"):
        return "unmatched"
    for template in app.openapi()["paths"]:
        pattern, _, _ = compile_path(template)
        if pattern.match(scope["path"]):
            return str(template)
    return "unmatched"


class BodyGate:
    """Reads the whole body once, within `timeout` seconds: decompresses `Content-Encoding:
    zstd|gzip` (exactly one gzip member or zstd frame, nothing after it), refuses more than
    `max_bytes` after decompression with 413, refuses JSON the contract cannot carry (duplicate keys,
    non-finite numbers, lone surrogates, deep nesting) with 422, then replays the plain body."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("identity", "", "zstd", "gzip", "x-gzip"):
            await send_json(send, 415, error_body(
                "invalid_request_error",
                f"Content-Encoding {echo(encoding)!r} is not supported; use zstd, gzip or none"))
            return
        if _declared_length(headers) > self._raw_limit(encoding):
            # Refused before a byte of it is read; the connection closes, as the rest would follow.
            await send_json(send, 413, self._too_large(), [(b"connection", b"close")])
            return
        content_type = headers.get(b"content-type")
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive, encoding)
            images: list[str] = []
            if _is_multipart(content_type):
                body, images = _request_part(body, content_type or b"")
                content_type = b"application/json"
            elif body and not _is_json(content_type):
                await send_json(send, 415, error_body("invalid_request_error", _not_json(content_type)))
                return
            if _is_json(content_type):
                value = read_json(body)
                _refuse_unnamed_images(value, images)
                # The route validates this value (api/preparation.py, request_body): parsed once.
                scope.setdefault("state", {})[PARSED_BODY] = value
        except TimeoutError:
            await send_json(send, 408, error_body(
                "request_timeout", f"the request body did not arrive within {self.timeout:g} s"),
                [(b"connection", b"close")])
            return
        except _TooLarge:
            await send_json(send, 413, self._too_large())
            return
        except _BadEncoding as exc:
            await send_json(send, 400, error_body("invalid_request_error", str(exc)))
            return
        except BodyRejected as exc:
            if exc.status != 422:  # bytes that are not text at all: an encoding error, not a field's
                await send_json(send, exc.status, error_body("invalid_request_error", exc.message))
                return
            await send_json(send, 422, orjson.dumps({"detail": [
                {"loc": ["body", *exc.loc], "msg": exc.message, "type": exc.kind}]}))
            return
        scope["headers"] = [(k, v) for k, v in scope["headers"]
                            if k not in (b"content-encoding", b"content-length", b"content-type")]
        scope["headers"].append((b"content-length", str(len(body)).encode()))
        if content_type is not None:
            scope["headers"].append((b"content-type", content_type))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices pass through

        await self.app(scope, replay, send)

    def _raw_limit(self, encoding: str) -> int:
        # A compressed body is never much larger than its content; bounding the raw bytes first
        # keeps memory bounded before decompression, which is itself capped at the limit.
        return self.max_bytes if encoding in ("identity", "") else self.max_bytes + 65536

    def _too_large(self) -> bytes:
        return error_body("request_too_large", f"request body exceeds {self.max_bytes} bytes (after decompression)")

    async def _read(self, receive: Receive, encoding: str) -> bytes:
        raw_limit = self._raw_limit(encoding)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _BadEncoding("client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > raw_limit:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if encoding in ("identity", ""):
            return raw
        return _decompress(raw, encoding, self.max_bytes)


class _TooLarge(Exception):
    pass


class _BadEncoding(Exception):
    pass


def _declared_length(headers: dict[bytes, bytes]) -> int:
    # The server's parser has already refused a malformed or repeated Content-Length; chunked has none.
    value = headers.get(b"content-length", b"0")
    return int(value) if value.isdigit() else 0


def _is_json(content_type: bytes | None) -> bool:
    # FastAPI reads a body as JSON under these types (a missing type is refused by the route).
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _not_json(content_type: bytes | None) -> str:
    sent = "no Content-Type" if content_type is None else f"Content-Type {content_type.decode('latin-1')!r}"
    hint = " (curl's default for --data; add -H 'Content-Type: application/json')" if content_type and \
        content_type.lower().startswith(b"application/x-www-form-urlencoded") else ""
    return f"the body must be JSON sent with `Content-Type: application/json`; this request had {sent}{hint}"


def _is_multipart(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"multipart/form-data"


def _request_part(raw: bytes, content_type: bytes) -> tuple[bytes, list[str]]:
    """A multipart body's `request` part (the JSON) and the names of its other parts: the form typesafe-sdk
    sends images in, one part per image beside the JSON, which names them in `assets`."""
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type + b"\r\n\r\n" + raw)
    parts = {str(part.get_param("name", header="content-disposition")): part for part in message.iter_parts()}
    request = parts.pop("request", None)
    body = request.get_payload(decode=True) if request is not None else None
    if not isinstance(body, bytes):
        raise BodyRejected([], "a multipart body needs a part named `request` holding the JSON request; "
                           "better, send the JSON itself with `Content-Type: application/json`", "missing")
    return body, list(parts)


def _refuse_unnamed_images(request: Any, images: list[str]) -> None:
    # Images the JSON names in `assets` are refused by the contract, with every other error in the request.
    if images and not (isinstance(request, dict) and request.get("assets") is not None):
        raise BodyRejected(["assets"], f"the multipart body carries parts {', '.join(images)} besides `request`: "
                           f"{ASSETS_REFUSED}", "text_only")


def _decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """The one gzip member or zstd frame in `raw`, at most `limit` bytes of it, with nothing after it."""
    try:
        plain, complete, rest = _zstd(raw, limit) if encoding == "zstd" else _gzip(raw, limit)
    except (zstandard.ZstdError, zlib.error) as exc:
        raise _BadEncoding(f"body is not valid {encoding}: {exc}") from exc
    if len(plain) > limit:
        raise _TooLarge
    if not complete:
        raise _BadEncoding(f"the {encoding} body is truncated: it ends before its end marker")
    if rest:
        unit = "frame" if encoding == "zstd" else "member"
        raise _BadEncoding(f"{len(rest)} bytes follow the {encoding} {unit}; "
                           f"send exactly one {unit} and nothing after it")
    return plain


def _gzip(raw: bytes, limit: int) -> tuple[bytes, bool, bytes]:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    plain = inflater.decompress(raw, limit + 1)
    return plain, inflater.eof, inflater.unused_data


def _zstd(raw: bytes, limit: int) -> tuple[bytes, bool, bytes]:
    # The stream reader bounds the output (a frame may claim any size); once the first frame is known
    # to fit, decompressobj decodes it again and reports whether it ended and what follows it.
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=False) as reader:
        bounded = reader.read(limit + 1)
    if len(bounded) > limit:
        return bounded, True, b""
    frame = zstandard.ZstdDecompressor().decompressobj()
    plain = frame.decompress(raw)
    return plain, frame.eof, frame.unused_data
