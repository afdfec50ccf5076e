"""The front door: per-connection limits the API server enforces before a request reaches the app,
as nginx does in front of one (header bytes, header and body read timeouts, open connections).

uvicorn has no header size limit or header timeout with httptools, so each connection's protocol is
uvicorn's own `HttpToolsProtocol` behind `FrontDoor`, which watches the same bytes with a second
httptools parser of its own and answers 431, 408 or 503 (JSON, with a request id) itself when a
limit is crossed. The body deadline is the body gate's (api/middleware.py), which answers 408 from
inside the app; here a body that never completes only gets its connection closed after it."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.middleware import error_body
from common.jobs import new_request_id
from common.settings import Settings

BODY_GRACE = 5.0  # seconds past the body timeout before the connection itself is closed
LINGER = 2.0  # seconds a refused connection is still read (and discarded) so the client sees the answer


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
        self.inner = HttpToolsProtocol(**uvicorn)
        self.loop = self.inner.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.refused = False  # answered by us; what still arrives is read and dropped until the close
        self.watching = True  # False once our parser gives up: uvicorn's answers malformed requests itself
        self.in_head = False  # inside a request's line and headers
        self.header_bytes = 0  # of the current request, as our parser reports them
        self.head_bytes = 0  # received while its head is incomplete (the parsers buffer them meanwhile)
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol, forwarded to uvicorn's protocol once the limits allow.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        if self.open.count >= self.limits.max_connections:
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds its limit of "
                         f"{self.limits.max_connections} open connections; retry shortly", retry_after=True)
            return
        self.open.count += 1
        self.admitted = True
        self._arm_header_timer()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused or not self.admitted or transport_closing(self.transport):
            return
        if self.watching:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.watching = False
                self._cancel_timers()
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

    # httptools callbacks of our own parser.

    def on_message_begin(self) -> None:
        self.in_head = True
        self.header_bytes = self.head_bytes = 0
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self.header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF count too

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._cancel(self.header_timer)
        self.header_timer = None
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

    def _refuse(self, status: HTTPStatus, message: str, retry_after: bool = False) -> None:
        assert self.transport is not None
        self._cancel_timers()
        self.watching = False
        body = error_body(_ERROR_TYPES[status], message)
        head = [f"HTTP/1.1 {status.value} {status.phrase}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close", f"x-typesafe-request-id: {new_request_id()}"]
        if retry_after:
            head.append("retry-after: 1")
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        # A lingering close, as nginx does: closing with unread bytes would send a reset, which can
        # destroy the answer before the client reads it. Stop writing, drain a while, then close.
        self.refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
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
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "request_too_large",
    HTTPStatus.REQUEST_TIMEOUT: "request_timeout",
    HTTPStatus.SERVICE_UNAVAILABLE: "unavailable_error",
}


def transport_closing(transport: asyncio.Transport | None) -> bool:
    return transport is None or transport.is_closing()
