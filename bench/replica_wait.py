"""What waiting for a replica's copy costs an async job's 202 (common/queue/replication.py): a write
like a placement, then `ReplicaCopy.wait`, timed on a master with one replica and, for the floor, on
the same master once the replica is gone (one INFO, no WAIT); and, between the two, with the replica
stopped (SIGSTOP: still connected for the master, confirming nothing), once with every promise waiting
its full 2 s (lagging_recheck 0, as before) and once as the code runs (LAGGING_RECHECK). Local processes
on loopback (the tests' Sentinel group), so the figures are Redis's and the client's own cost, not a
network's.

    uv run --extra cpu --extra dev python -m bench.replica_wait [--writes 2000] [--stall-seconds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import statistics
import tempfile
import time
from pathlib import Path

from common.queue.replication import LAGGING_RECHECK, ReplicaCopy
from common.redis_connection import redis_connection
from harness.sentinels import SentinelGroup, settings_for


async def timed_writes(group: SentinelGroup, writes: int | None = None, seconds: float | None = None,
                       lagging_recheck: float = LAGGING_RECHECK) -> list[float]:
    """Milliseconds per write + wait, one after another: `writes` of them, or as many as `seconds` allow.
    `lagging_recheck`: the ReplicaCopy's (0: after a timed-out wait every promise still waits its full
    timeout, as before LAGGING_RECHECK)."""
    client = redis_connection(settings_for(group))
    copies = ReplicaCopy(client, lagging_recheck=lagging_recheck)
    end = time.perf_counter() + seconds if seconds is not None else math.inf
    took: list[float] = []
    try:
        while len(took) < (writes or math.inf) and time.perf_counter() < end:
            started = time.perf_counter()
            await client.hset(f"bench:replica-wait:{len(took) % 100}", mapping={"status": "queued", "n": len(took)})
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
    parser.add_argument("--stall-seconds", type=float, default=12.0,
                        help="seconds of writes per setting while the replica is stopped")
    args = parser.parse_args()
    group = SentinelGroup(Path(tempfile.mkdtemp(prefix="openjev-replica-wait-")))
    try:
        group.wait_ready()
        with_replica = asyncio.run(timed_writes(group, args.writes))
        group.replica.send_signal(signal.SIGSTOP)
        try:
            stalled = {recheck: asyncio.run(timed_writes(group, seconds=args.stall_seconds, lagging_recheck=recheck))
                       for recheck in (0.0, LAGGING_RECHECK)}
        finally:
            group.replica.send_signal(signal.SIGCONT)
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
    for recheck, took in stalled.items():
        print(f"replica stopped, {args.stall_seconds:g} s of writes one after another, lagging_recheck {recheck:g} s: "
              f"{len(took)} writes ({len(took) / args.stall_seconds:.1f}/s), mean {statistics.mean(took):.1f} ms, "
              f"{sum(t >= 1000 for t in took)} waited the full timeout")


if __name__ == "__main__":
    main()
