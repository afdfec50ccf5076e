"""The front door: per-connection limits the API server enforces before a request reaches the app,
as nginx does in front of one (header bytes, header and body read timeouts, open connections), and
the contract's JSON error (with a request id) for every request it will not pass on.

uvicorn has no header timeout and answers a malformed request with a plain-text 400, so each
connection's protocol is uvicorn's own h11 protocol behind `FrontDoor`, which sees the same bytes
first through an httptools parser of its own (driven only through the public asyncio.Protocol
methods) and answers 400, 405, 408, 431 or 503 itself. h11 rather than uvicorn's httptools protocol:
h11 turns down a protocol switch (`Upgrade: h2c`, `Upgrade: websocket`) by answering over HTTP/1.1 and
keeps the connection, as nginx does, where httptools stops parsing the connection after one. The body
deadline is the body gate's (api/middleware.py), which answers 408 from inside the app; here a body
that never completes only gets its connection closed after it. Every close of a connection whose request is
still arriving lingers (ours, and uvicorn's after the app's early answers: `LingeringClose`), so the bytes
the client sends on are read and dropped rather than answered with a reset that can take the answer with it."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.errors import error_body
from common.jobs import new_request_id
from common.settings import Settings

BODY_GRACE = 5.0  # seconds past the body timeout before the connection itself is closed
LINGER = 2.0  # seconds a refused connection is still read (and discarded) so the client sees the answer
READ_SLACK = 256 * 1024  # bytes: one socket read, so that h11's own head limit never trips before our 431


@dataclass(frozen=True)
class FrontDoorLimits:
    """The limits of one server, from the settings."""

    max_header_bytes: int  # request line plus header names and values
    header_timeout: float  # seconds from a request's first byte (or the connection's opening) to its headers' end
    body_timeout: float  # seconds for the whole body, counted from the end of the headers
    max_connections: int  # open connections; the next one is answered 503 and closed

    @classmethod
    def from_settings(cls, settings: Settings) -> FrontDoorLimits:
        return cls(settings.max_header_bytes, settings.header_timeout, settings.body_timeout,
                   settings.max_connections)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments for `uvicorn.Config` that put the front door in place."""
    limits = FrontDoorLimits.from_settings(settings)
    return {"http": functools.partial(FrontDoor, limits=limits, open_connections=OpenConnections()),
            "h11_max_incomplete_event_size": settings.max_header_bytes + READ_SLACK,
            "ws": "none",  # no route is a WebSocket: `Upgrade: websocket` is answered over HTTP/1.1 too
            "timeout_keep_alive": settings.keep_alive_timeout}


class OpenConnections:
    """How many connections are open on one server; shared by all of its `FrontDoor`s."""

    def __init__(self) -> None:
        self.count = 0


class FrontDoor(asyncio.Protocol):
    """One connection: the limits are checked on the raw bytes, then the bytes go to uvicorn."""

    def __init__(self, *, limits: FrontDoorLimits, open_connections: OpenConnections, **uvicorn: Any) -> None:
        self.limits = limits
        self.open = open_connections
        self.inner = H11Protocol(**uvicorn)
        self.loop = self.inner.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.refused = False  # answered by us; what still arrives is read and dropped until the close
        self.in_head = False  # inside a request's line and headers
        self.hosts = 0  # Host headers of the current request
        self.header_bytes = 0  # of the current request, as our parser reports them
        self.head_bytes = 0  # received while its head is incomplete (the parsers buffer them meanwhile)
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol, forwarded to uvicorn's protocol once the limits allow.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        if self.open.count >= self.limits.max_connections:
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds its limit of "
                         f"{self.limits.max_connections} open connections; retry shortly", {"retry-after": "1"})
            return
        self.open.count += 1
        self.admitted = True
        self._arm_header_timer()
        self.inner.connection_made(LingeringClose(transport, self))

    def data_received(self, data: bytes) -> None:
        if self.refused or not self.admitted or transport_closing(self.transport):
            return
        self._watch(data)
        if self.refused:
            return
        if self.in_head:
            self.head_bytes += len(data)
        if max(self.header_bytes, self.head_bytes) > self.limits.max_header_bytes:
            self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                         f"the request line and headers exceed {self.limits.max_header_bytes} bytes")
            return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self.admitted:
            self.admitted = False
            self.open.count -= 1
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def _watch(self, data: bytes) -> None:
        """Our parser reads `data`; a malformed request, or CONNECT, is refused before uvicorn sees it."""
        while True:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as switch:
                if self.parser.get_method() == b"CONNECT":
                    self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "CONNECT is not served here: this is an API "
                                 "server, not a proxy", {"allow": "GET, POST, DELETE"})
                    return
                # A protocol switch proposal: h11 answers it over HTTP/1.1, and what follows is the next request.
                self.parser = httptools.HttpRequestParser(self)
                data = data[switch.args[0]:]
            except httptools.HttpParserError as exc:
                self._refuse(HTTPStatus.BAD_REQUEST, f"malformed HTTP/1.1 request: {exc}")
                return

    # httptools callbacks of our own parser.

    def on_message_begin(self) -> None:
        self.in_head = True
        self.hosts = 0
        self.header_bytes = self.head_bytes = 0
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self.header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF count too
        self.hosts += name.lower() == b"host"

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._cancel(self.header_timer)
        self.header_timer = None
        # What h11 would refuse with uvicorn's plain-text 400 where httptools lets it through:
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            self._refuse(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"HTTP/{version} is not served here; use HTTP/1.1")
        elif self.hosts > 1 or (version == "1.1" and not self.hosts):  # RFC 9112 3.2
            self._refuse(HTTPStatus.BAD_REQUEST, "malformed HTTP/1.1 request: it needs exactly one Host header")
        if self.refused:
            return
        self.body_timer = self.loop.call_later(self.limits.body_timeout + BODY_GRACE, self._body_overdue)

    def on_message_complete(self) -> None:
        self._cancel(self.body_timer)
        self.body_timer = None

    # The limits.

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self.header_timer = None
        self._refuse(HTTPStatus.REQUEST_TIMEOUT, f"the request headers did not arrive within "
                     f"{self.limits.header_timeout:g} s")

    def _body_overdue(self) -> None:
        # The body gate has answered 408 by now if the app was reading the body; nothing more can come.
        self.body_timer = None
        if self.transport is not None:
            self.transport.close()

    def _refuse(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        assert self.transport is not None
        self._cancel_timers()
        if self.refused:
            return
        body = error_body(_ERROR_TYPES[status], message)
        head = [f"HTTP/1.1 {status.value} {status.phrase}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close", f"x-typesafe-request-id: {new_request_id()}",
                *(f"{name}: {value}" for name, value in (headers or {}).items())]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.linger()

    def reading_request(self) -> bool:
        """True while a request's head or body is still arriving: closing now could leave bytes unread."""
        return self.in_head or self.body_timer is not None

    def linger(self) -> None:
        """A lingering close, as nginx does: closing with unread bytes would send a reset, which can destroy
        the answer before the client reads it. Stop writing, drain (and drop) what still comes a while, then
        close."""
        assert self.transport is not None
        self._cancel_timers()
        self.refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if not self.transport.is_reading():
            self.transport.resume_reading()
        self.loop.call_later(LINGER, self.transport.close)

    def _cancel_timers(self) -> None:
        self._cancel(self.header_timer)
        self._cancel(self.body_timer)
        self.header_timer = self.body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "method_not_allowed",
    HTTPStatus.HTTP_VERSION_NOT_SUPPORTED: "invalid_request_error",
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "request_too_large",
    HTTPStatus.REQUEST_TIMEOUT: "request_timeout",
    HTTPStatus.SERVICE_UNAVAILABLE: "unavailable_error",
}


class LingeringClose(asyncio.Transport):
    """The connection's transport as uvicorn's protocol sees it: the same, except that uvicorn's close of a
    connection whose request is still arriving (the body gate's 408 to a trickled body, any answer given before
    the body was read) lingers as the front door's own refusals do, instead of resetting the connection under
    an answer the client has not read yet. Any other close (an idle keep-alive, a shutdown) is at once."""

    def __init__(self, transport: asyncio.Transport, door: FrontDoor) -> None:
        super().__init__()
        self.transport = transport
        self.door = door

    def close(self) -> None:
        if self.door.refused:
            return  # lingering already (the front door's own refusal, or an earlier close): it closes by itself
        if self.door.reading_request() and not self.transport.is_closing():
            self.door.linger()
        else:
            self.transport.close()

    def is_closing(self) -> bool:
        return self.door.refused or self.transport.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self.transport.write_eof()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def abort(self) -> None:
        self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.transport.get_write_buffer_limits()


def transport_closing(transport: asyncio.Transport | None) -> bool:
    return transport is None or transport.is_closing()
