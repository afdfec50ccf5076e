"""The worker's HTTP/1.1 client for the engine (worker/engine_http.py) against a real socket server in
this process whose answers each test scripts byte for byte: keep-alive reuse, the three ways an answer's
body ends (Content-Length, chunked, the connection's end), the byte bound, timeouts, cancellation, an
engine that closes or garbles a connection, and the pool's bound. Every test runs on asyncio's own loop
and on uvloop's (the worker's). The same client against the scripted engine and real SGLang:
tests/test_engine_client.py, tests/test_sglang_real.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from worker.engine_http import CallTimeout, ConnectionClosed, EngineHttp, ProtocolError

LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"

# What the server answers a request with: bytes to send back (b"" sends nothing), or a coroutine function
# of the connection's transport that does what the test needs.
Reply = bytes | Callable[[asyncio.Transport], Awaitable[None]]


class Engine(asyncio.Protocol):
    """One connection of the scripted server: each whole request it reads (a head, then Content-Length
    bytes) is answered with the server's next reply."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.append(self)
        self.server.opened += 1
        self.server.open += 1
        self.server.most_open = max(self.server.most_open, self.server.open)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open -= 1
        self.server.closed.set()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.server.requests.append(head + b"\r\n\r\n" + rest[:length])
            reply = self.server.replies.pop(0) if self.server.replies else OK
            assert self.transport is not None
            if isinstance(reply, bytes):
                self.transport.write(reply)
            else:
                self.server.tasks.add(asyncio.ensure_future(reply(self.transport)))


class Server:
    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[bytes] = []
        self.connections: list[Engine] = []
        self.opened = self.open = self.most_open = 0
        self.closed = asyncio.Event()  # set each time a connection closes
        self.tasks: set[asyncio.Future[None]] = set()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.get_running_loop().create_server(lambda: Engine(self), "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: Any) -> None:
        assert self._server is not None
        self._server.close()
        for task in self.tasks:
            task.cancel()

    async def wait_closed(self, open_left: int = 0) -> None:
        async with asyncio.timeout(5):
            while self.open > open_left:
                self.closed.clear()
                await self.closed.wait()


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    return LOOPS[request.param]


def test_calls_reuse_one_connection_and_send_the_head_and_body(run: Callable[..., None]) -> None:
    async def main() -> None:
        async with Server() as server:
            http = EngineHttp(server.url, {"Authorization": "Bearer k"})
            for i in range(5):
                answer = await http.request("POST", "/generate", 5, b'{"i":%d}' % i)
                assert answer == (200, b'{"ok":true}')
            assert (await http.request("GET", "/health", 5)).status == 200
            await http.aclose()
            assert server.opened == 1
            first = server.requests[0]
            assert first.startswith(b"POST /generate HTTP/1.1\r\n") and first.endswith(b'\r\n\r\n{"i":0}')
            assert b"Authorization: Bearer k\r\n" in first and b"Content-Length: 7\r\n" in first
            assert server.requests[-1].startswith(b"GET /health HTTP/1.1\r\n")
            assert b"Content-Length" not in server.requests[-1]

    run(main())


def test_a_chunked_answer_and_one_ended_by_the_connection_are_read_whole(run: Callable[..., None]) -> None:
    async def answer_then_close(transport: asyncio.Transport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nbusy, ")
        await asyncio.sleep(0.05)
        transport.write(b"try later")
        transport.close()

    async def main() -> None:
        async with Server() as server:
            server.replies = [
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n",
                answer_then_close,
            ]
            http = EngineHttp(server.url)
            assert await http.request("POST", "/generate", 5, b"{}") == (200, b'{"a":1}')
            assert await http.request("GET", "/health", 5) == (503, b"busy, try later")
            assert await http.request("GET", "/health", 5) == (200, b'{"ok":true}')
            assert server.opened == 2  # the first connection served two answers; the engine's close ended it
            await http.aclose()

    run(main())


def test_an_answer_past_the_bound_is_not_read_and_its_connection_is_closed(run: Callable[..., None]) -> None:
    async def main() -> None:
        async with Server() as server:
            big = b"x" * 1000
            server.replies = [
                b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + big,
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + big + b"\r\n0\r\n\r\n",
            ]
            http = EngineHttp(server.url)
            assert await http.request("POST", "/generate", 5, b"{}", limit=100) == (200, None)
            await server.wait_closed()
            assert await http.request("POST", "/generate", 5, b"{}", limit=100) == (200, None)
            await server.wait_closed()
            assert await http.request("POST", "/generate", 5, b"{}", limit=100) == (200, b'{"ok":true}')
            assert server.opened == 3
            await http.aclose()

    run(main())


def test_a_call_that_times_out_or_is_cancelled_closes_its_connection(run: Callable[..., None]) -> None:
    async def main() -> None:
        async with Server() as server:
            server.replies = [b"", b""]  # two requests never answered
            http = EngineHttp(server.url)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(CallTimeout):
                await http.request("POST", "/generate", 0.2, b"{}")
            # Not before its timeout; uvloop's clock is libuv's, in whole milliseconds, so 0.2 s read on it can
            # come out a float's hair under 0.2 (CI saw 0.19999...).
            assert 0.199 <= loop.time() - started < 2
            await server.wait_closed()
            call = asyncio.ensure_future(http.request("POST", "/generate", 30, b"{}"))
            while len(server.requests) < 2:
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await server.wait_closed()
            assert await http.request("POST", "/generate", 5, b"{}") == (200, b'{"ok":true}')
            assert server.opened == 3
            await http.aclose()

    run(main())


def test_an_engine_that_closes_or_garbles_the_connection_fails_the_call(run: Callable[..., None]) -> None:
    async def cut_short(transport: asyncio.Transport) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"partial\"")
        transport.close()

    async def main() -> None:
        async with Server() as server:
            server.replies = [cut_short, b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]
            http = EngineHttp(server.url)
            with pytest.raises(ConnectionClosed):
                await http.request("POST", "/generate", 5, b"{}")
            with pytest.raises(ProtocolError):
                await http.request("POST", "/generate", 5, b"{}")
            assert await http.request("POST", "/generate", 5, b"{}") == (200, b'{"ok":true}')
            await http.aclose()
        nobody = EngineHttp(server.url)  # the server is gone: nothing listens there
        with pytest.raises(OSError):
            await nobody.request("GET", "/health", 5)

    run(main())


def test_a_connection_the_engine_closed_while_idle_or_one_past_its_keep_alive_is_not_reused(
        run: Callable[..., None]) -> None:
    async def main() -> None:
        async with Server() as server:
            http = EngineHttp(server.url)
            await http.request("GET", "/health", 5)
            assert http.idle_connections == 1
            for connection in server.connections:
                assert connection.transport is not None
                connection.transport.close()  # as the engine's uvicorn does after 5 s idle
            async with asyncio.timeout(5):
                while http.idle_connections:  # the client's loop sees the engine's close
                    await asyncio.sleep(0.01)
            assert await http.request("GET", "/health", 5) == (200, b'{"ok":true}')
            server.replies = [b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"]
            assert await http.request("GET", "/health", 5) == (200, b"")
            assert http.idle_connections == 0  # "Connection: close": not kept
            assert await http.request("GET", "/health", 5) == (200, b'{"ok":true}')
            assert server.opened == 3
            expiring = EngineHttp(server.url, keepalive_expiry=0.0)  # every idle connection has expired
            for _ in range(3):
                assert (await expiring.request("GET", "/health", 5)).status == 200
            assert server.opened == 3 + 3
            await http.aclose()
            await expiring.aclose()
            await server.wait_closed()

    run(main())


def test_the_pool_opens_at_most_max_connections_and_waits_for_one_within_the_timeout(
        run: Callable[..., None]) -> None:
    async def slow(transport: asyncio.Transport) -> None:
        await asyncio.sleep(0.3)
        transport.write(OK)

    async def main() -> None:
        async with Server() as server:
            server.replies = [slow] * 6
            http = EngineHttp(server.url, max_connections=2)
            answers = await asyncio.gather(*(http.request("POST", "/generate", 5, b"{}") for _ in range(6)))
            assert all(a == (200, b'{"ok":true}') for a in answers)
            assert server.most_open == 2 and server.opened == 2
            server.replies = [slow, slow]
            held = [asyncio.ensure_future(http.request("POST", "/generate", 5, b"{}")) for _ in range(2)]
            async with asyncio.timeout(5):
                while len(server.requests) < 6 + 2:  # both connections are busy
                    await asyncio.sleep(0.01)
            with pytest.raises(CallTimeout, match="no connection"):
                await http.request("POST", "/generate", 0.05, b"{}")
            await asyncio.gather(*held)
            await http.aclose()

    run(main())


def test_only_plain_http_engine_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="expected http://"):
        EngineHttp("https://engine.internal:30000")
    assert EngineHttp("http://engine.internal:30000/").base_url == "http://engine.internal:30000"
