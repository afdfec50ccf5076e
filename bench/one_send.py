"""What one send less per response saves: a uvloop server answering each request with a 300-byte
response, written in one call to the transport or in two (head, then body: what uvicorn's h11 protocol
does), under 16 keep-alive clients on loopback. The figure is the server process's CPU per request (user +
system, /proc), modes interleaved. It decided against coalescing the API's response writes (tried on
2026-12-06 as a transport wrapper in api/front_door.py, then reverted): 2.5 µs per request is not worth it.

    uv run --extra cpu --extra dev python -m bench.one_send [--requests 20000] [--rounds 4]

Figures: bench/RESULTS-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys

import uvloop

from harness.procfs import cpu_seconds
from openjev.embedded_redis import free_port

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 300\r\n\r\n"
BODY = b"x" * 300
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
CLIENTS = 16


class Answering(asyncio.Protocol):
    def __init__(self, sends: int) -> None:
        self.sends = sends
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        for _ in range(data.count(b"\r\n\r\n")):
            if self.sends == 1:
                self.transport.write(HEAD + BODY)
            else:
                self.transport.write(HEAD)
                self.transport.write(BODY)


async def serve(port: int, sends: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: Answering(sends), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def client(port: int, requests: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(requests):
        writer.write(REQUEST)
        await reader.readexactly(len(HEAD) + len(BODY))
    writer.close()


async def load(port: int, requests: int) -> None:
    await asyncio.gather(*(client(port, requests // CLIENTS) for _ in range(CLIENTS)))


def measure(sends: int, requests: int) -> float:
    """Microseconds of the server's CPU per request."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.one_send", "--serve", str(port), "--sends", str(sends)])
    try:
        uvloop.run(_connected(port))
        before = cpu_seconds(server.pid)
        uvloop.run(load(port, requests))
        return (cpu_seconds(server.pid) - before) * 1e6 / requests
    finally:
        server.terminate()
        server.wait(10)


async def _connected(port: int) -> None:
    for _ in range(100):
        try:
            await client(port, 1)
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sends", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve(args.serve, args.sends))
        return 0
    samples: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for sends in (1, 2) if r % 2 == 0 else (2, 1):
            samples[sends].append(measure(sends, args.requests))
    one, two = statistics.median(samples[1]), statistics.median(samples[2])
    print("| response written in | server CPU-µs per request (median of rounds) |\n|---|---|")
    print(f"| one send | {one:.1f} |\n| two sends | {two:.1f} |")
    print(f"one send saves {two - one:.1f} µs per request ({(two - one) / two:.0%} of this minimal server's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
