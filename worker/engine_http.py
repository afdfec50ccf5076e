"""HTTP/1.1 to the engine: a pool of keep-alive connections, each an asyncio protocol that writes a
request in one send and reads the answer with httptools' response parser (the parser uvicorn uses).

The worker's engine calls are a few small JSON POSTs per job to one known host on loopback or the
private network. httpcore's pool (httpx's transport, used here before) sent each request as two writes
(head, then body), polled every pooled connection on each request to see that it was still open, and
ran every call through anyio's cancel scopes; on a 2-vCPU VM the send system calls alone were a quarter
of the worker's CPU. Here a call is one write and one future, a connection closed by the engine is
noticed when the loop reports it (`connection_lost`), and an idle connection is not reused past
`keepalive_expiry` (before the engine's uvicorn closes it at 5 s). Figures: `python -m bench.engine_http`,
bench/RESULTS-cpu.md.

A call that is cancelled, times out or is answered past its byte bound closes its connection: what is
left of the answer is never read. Nothing is retried here: a POST may already have reached the engine."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT = 5.0  # seconds; an engine that does not accept a connection by then is not there


class CallTimeout(Exception):
    """No whole answer within the call's time."""


class ConnectionClosed(ConnectionError):
    """The engine closed the connection before its answer ended."""


class ProtocolError(Exception):
    """The engine's bytes are not an HTTP/1.1 answer."""


# What a call can fail with short of an answer, other than `CallTimeout`.
TRANSPORT_ERRORS = (ProtocolError, OSError)


class Answer(NamedTuple):
    """An HTTP answer: its status and whole body; the body is None when it passed the call's byte bound
    (the rest was never read)."""

    status: int
    body: bytes | None


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one call at a time (no pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # monotonic
        self._answer: asyncio.Future[Answer] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = 0
        self._length_known = False  # a Content-Length or chunked body; otherwise the body ends with the connection
        self._headers_done = False
        self._reusable = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            self.close()  # bytes nobody asked for: the connection's state is unknown
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.fail(ProtocolError(f"engine sent a malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self._answer
        if answer is None or answer.done():
            return
        if self._headers_done and not self._length_known:
            self._finish(b"".join(self._chunks))  # an answer delimited by the end of the connection
        else:
            self.fail(ConnectionClosed(f"engine closed the connection before its answer ended ({exc!r})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._length_known = True
            if value.strip().isdigit() and int(value) > self._limit:
                self._finish(None)
        elif name == b"transfer-encoding":
            self._length_known = True

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        if self._answer is None or self._answer.done():
            return
        self._size += len(body)
        if self._size > self._limit:
            self._finish(None)
        else:
            self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._reusable = self._parser.should_keep_alive()
        self._finish(b"".join(self._chunks))

    # the pool's side
    def send(self, request: list[bytes], limit: int) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._chunks, self._size, self._limit = [], 0, limit
        self._length_known = self._headers_done = self._reusable = False
        self.transport.writelines(request)
        return self._answer

    def reusable(self) -> bool:
        """Whether the last answer ended cleanly on a connection both sides keep open."""
        return self._reusable and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _finish(self, body: bytes | None) -> None:
        answer = self._answer
        if answer is None or answer.done():
            return
        answer.set_result(Answer(self._parser.get_status_code(), body))
        if body is None:
            self.close()  # the rest of an answer past its bound is never read

    def fail(self, exc: Exception) -> None:
        """End the call in flight with `exc` (its time ran out, or the bytes are broken) and close the connection."""
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        self.close()


class EngineHttp:
    """A pool of keep-alive HTTP/1.1 connections to one engine (http:// only: the engine is on loopback
    or the private network)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, max_connections: int = 16,
                 keepalive_expiry: float = 2.0) -> None:
        """`keepalive_expiry`: seconds an idle connection may be reused; it must stay under the engine's own
        idle limit (uvicorn's 5 s), or a reused one could be closed under a request in flight."""
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"engine URL {base_url!r}: expected http://host[:port][/path]")
        self.base_url = base_url.rstrip("/")
        self._host, self._port = url.hostname, url.port or 80
        self._path = url.path.rstrip("/")
        host = url.netloc.encode("idna")
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._fixed = b"Host: " + host + b"\r\n" + self._headers
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()  # most recently used last
        self._open: set[_Connection] = set()
        self.keepalive_expiry = keepalive_expiry

    async def request(self, method: str, path: str, timeout: float, body: bytes | None = None,
                      limit: int = 64 * 1024 * 1024, content_type: str = "application/json") -> Answer:
        """Send a request and read its answer, all within `timeout` seconds (a connection, if one must be
        opened, within CONNECT_TIMEOUT of them). An answer over `limit` bytes comes back with body None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._slots.locked():
            try:
                async with asyncio.timeout_at(deadline):
                    await self._slots.acquire()
            except TimeoutError:
                raise CallTimeout(f"no connection to the engine free within {timeout:g} s") from None
        else:
            await self._slots.acquire()
        try:
            connection = self._reuse() or await self._connect(min(CONNECT_TIMEOUT, deadline - loop.time()))
            self._open.add(connection)
            head = (f"{method} {self._path}{path} HTTP/1.1\r\n".encode() + self._fixed
                    + (b"" if body is None else
                       f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n".encode()) + b"\r\n")
            answer = connection.send([head] if body is None else [head, body], limit)
            timer = loop.call_at(deadline, connection.fail, CallTimeout(f"no answer within {timeout:g} s"))
            try:
                result = await answer
            except BaseException:
                connection.close()  # cancelled, timed out or broken: what is left of the answer is never read
                self._open.discard(connection)
                raise
            finally:
                timer.cancel()
            self._open.discard(connection)
            if connection.reusable():
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()
            return result
        finally:
            self._slots.release()

    @property
    def idle_connections(self) -> int:
        """Connections open and waiting for the next call."""
        return sum(not connection.closed for connection in self._idle)

    def _reuse(self) -> _Connection | None:
        """The most recently used idle connection still open and within its keep-alive time; the
        expired ones are closed."""
        oldest_allowed = time.monotonic() - self.keepalive_expiry
        while self._idle and (self._idle[0].closed or self._idle[0].idle_since < oldest_allowed):
            self._idle.popleft().close()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                _, connection = await loop.create_connection(_Connection, self._host, self._port)
        except TimeoutError:
            raise CallTimeout(f"engine at {self.base_url} did not accept a connection within {timeout:g} s") \
                from None
        return connection

    async def aclose(self) -> None:
        for connection in [*self._idle, *self._open]:
            connection.close()
        self._idle.clear()
        self._open.clear()
