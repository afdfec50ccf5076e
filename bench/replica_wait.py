"""What waiting for a replica's copy costs an async job's 202 (common/queue/replication.py): a write
like a placement, then `ReplicaCopy.wait`, timed on a master with one replica and, for the floor, on
the same master once the replica is gone (one INFO, no WAIT). Local processes on loopback (the tests'
Sentinel group), so the figures are Redis's and the client's own cost, not a network's.

    uv run --extra cpu --extra dev python -m bench.replica_wait [--writes 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from common.queue.replication import ReplicaCopy
from common.redis_connection import redis_connection
from harness.sentinels import SentinelGroup, settings_for


async def timed_writes(group: SentinelGroup, writes: int) -> list[float]:
    """Milliseconds per write + wait, one after another."""
    client = redis_connection(settings_for(group))
    copies = ReplicaCopy(client)
    took = []
    try:
        for i in range(writes):
            started = time.perf_counter()
            await client.hset(f"bench:replica-wait:{i % 100}", mapping={"status": "queued", "n": i})
            await copies.wait()
            took.append((time.perf_counter() - started) * 1000)
    finally:
        await client.aclose()
    return took


def summary(name: str, took: list[float]) -> str:
    ordered = sorted(took)
    p99 = ordered[int(len(ordered) * 0.99) - 1]
    return f"{name}: {len(took)} writes, p50 {statistics.median(took):.3f} ms, p99 {p99:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=2000)
    args = parser.parse_args()
    group = SentinelGroup(Path(tempfile.mkdtemp(prefix="openjev-replica-wait-")))
    try:
        group.wait_ready()
        with_replica = asyncio.run(timed_writes(group, args.writes))
        group.client(group.replica_port).shutdown(nosave=True)
        deadline = time.monotonic() + 10
        while group.client(group.master_port).info("replication")["connected_slaves"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the master still counts its replica")
            time.sleep(0.05)
        alone = asyncio.run(timed_writes(group, args.writes))
    finally:
        group.stop()
    print(summary("write + WAIT 1 (one replica)", with_replica))
    print(summary("write + INFO (no replica)", alone))


if __name__ == "__main__":
    main()
