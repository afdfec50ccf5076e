"""How often Redis acknowledges a write before it is in its append-only file, and what waiting for
the file costs an async job's 202 (`api.queue_client.AppendOnlyFile`).

With `appendfsync everysec`, Redis postpones writing to the file (by up to 2 s) while its background
fsync of the previous second runs, and replies anyway; a crash of Redis then loses the acknowledged
write. This starts the project's own Redis (as `openjev serve` runs it) and writes job-sized values
one at a time, alternating two ways between rounds: acknowledged as Redis replies ("reply"), and
acknowledged once `AppendOnlyFile.wait()` returns ("reply + wait", what the API does for an async
job). After each acknowledgement it reads the file itself: a key not in it is one a `kill -9` of Redis
at that instant would lose. With `--stress`, a second process writes and fsyncs a file beside the
data meanwhile (a busy disk: other services, a backup, the page cache flushing).

    uv run --extra cpu --extra dev python -m bench.aof_window [--writes 1000] [--stress]

Figures: bench/RESULTS-durability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio

from api.queue_client import AppendOnlyFile
from bench.queue_latency import percentile
from harness.aof import in_file, start_stress
from openjev.embedded_redis import RedisServer

ROUNDS = 10  # per way, alternating, so drift in the disk's load hits both alike
VALUE = b"x" * 2048  # about a job's payload and record


async def one_round(client: redis.asyncio.Redis, written: AppendOnlyFile, data_dir: Path, way: str,
                    writes: int, start: int) -> tuple[list[float], int, int]:
    """Latencies (ms) of `writes` acknowledgements, how many were not in the file when acknowledged,
    and how many waits gave up."""
    latencies: list[float] = []
    missing = gave_up = 0
    for i in range(start, start + writes):
        key = f"openjev:bench:{i}".encode()
        started = time.perf_counter()
        await client.set(key, VALUE)
        if way == "reply + wait" and not await written.wait():
            gave_up += 1
        latencies.append((time.perf_counter() - started) * 1000)
        missing += not in_file(data_dir, key)
        await asyncio.sleep(0.005)  # a request's pace, not a tight loop
    return latencies, missing, gave_up


async def bench(server: RedisServer, writes: int) -> list[str]:
    client = redis.asyncio.Redis.from_url(server.url)
    written = AppendOnlyFile(client)
    ways = ("reply", "reply + wait")
    latencies: dict[str, list[float]] = {way: [] for way in ways}
    missing = dict.fromkeys(ways, 0)
    gave_up = dict.fromkeys(ways, 0)
    start = 0
    for _ in range(ROUNDS):
        for way in ways:
            took, lost, quit = await one_round(client, written, server.data_dir, way, writes // ROUNDS // 2, start)
            start += writes // ROUNDS // 2
            latencies[way] += took
            missing[way] += lost
            gave_up[way] += quit
    await client.aclose()
    lines = ["| acknowledged at | writes | not yet in the file | waits that gave up | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|"]
    for way in ways:
        n = len(latencies[way])
        lines.append(f"| {way} | {n} | {missing[way]} ({missing[way] / n:.1%}) | {gave_up[way]} | "
                     f"{percentile(latencies[way], 0.5):.2f} | {percentile(latencies[way], 0.99):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=1000, help="acknowledgements in all, half each way")
    parser.add_argument("--stress", action="store_true", help="write and fsync a file beside the data meanwhile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="openjev-aof-", dir=os.environ.get("OPENJEV_BENCH_DIR")) as tmp:
        server = RedisServer.on(Path(tmp) / "redis")
        server.start()
        stress = None
        try:
            server.wait_ready()
            stress = start_stress(Path(tmp)) if args.stress else None
            lines = asyncio.run(bench(server, args.writes))
        finally:
            if stress is not None:
                os.killpg(stress.pid, 9)
                stress.wait()
            server.stop()
    print(f"{args.writes} writes, {'with' if args.stress else 'without'} fsync stress:", file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
