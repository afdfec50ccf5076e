"""HTTP to the engine: httpcore's connection pool, the transport under httpx, used on its own. The
worker's engine calls are a few small JSON POSTs per job to one known host, where httpx's client
layers (URL merging, the auth and redirect flows, cookies, event hooks, response models) cost as much
CPU as half the transport: 2.1 against 1.4 CPU-ms per `/generate` call, measured side by side
(`python -m bench.engine_http`, bench/RESULTS-cpu.md). `TRANSPORT_ERRORS` and `TimeoutException` are
what a call can raise short of an answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpcore

CONNECT_TIMEOUT = 5.0  # seconds; an engine that does not accept a connection by then is not there
# What a call can fail with short of an answer (a timeout is `httpcore.TimeoutException`).
TRANSPORT_ERRORS = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError)
TimeoutException = httpcore.TimeoutException


class EngineHttp:
    """A pool of keep-alive HTTP/1.1 connections to one engine."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, max_connections: int = 16,
                 keepalive_expiry: float = 2.0) -> None:
        """`keepalive_expiry`: idle connections close before the engine's uvicorn closes them (5 s), or a
        reused one could be closed under a request in flight."""
        self.base_url = base_url.rstrip("/")
        self._headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self._pool = httpcore.AsyncConnectionPool(max_connections=max_connections,
                                                  max_keepalive_connections=max_connections,
                                                  keepalive_expiry=keepalive_expiry)

    @asynccontextmanager
    async def stream(self, method: str, path: str, timeout: float, body: bytes | None = None,
                     content_type: str = "application/json") -> AsyncIterator[httpcore.Response]:
        """Send a request and yield the response with its body unread (`aiter_stream`). `timeout`
        bounds the connection's acquisition and each read and write (at most CONNECT_TIMEOUT to connect)."""
        headers = self._headers if body is None else [*self._headers, (b"Content-Type", content_type.encode())]
        limits = {"connect": min(CONNECT_TIMEOUT, timeout), "read": timeout, "write": timeout, "pool": timeout}
        async with self._pool.stream(method, self.base_url + path, headers=headers, content=body,
                                     extensions={"timeout": limits}) as response:
            yield response

    async def request(self, method: str, path: str, timeout: float, body: bytes | None = None) -> tuple[int, bytes]:
        """Send a request; its status and whole body."""
        async with self.stream(method, path, timeout, body) as response:
            return response.status, await response.aread()

    async def aclose(self) -> None:
        await self._pool.aclose()


def header(response: httpcore.Response, name: bytes) -> bytes | None:
    """The first value of header `name` (lowercase) in `response`, if any."""
    return next((value for key, value in response.headers if key.lower() == name), None)
