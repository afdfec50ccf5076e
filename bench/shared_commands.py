"""Redis commands per async job of the queue's own scripts (INFO commandstats deltas, those a script runs
included): place (headroom 0.1), claim and start, store; arq's run_job and finish_job are not run. `one`: a
queue of one tenant; `shared`: tenants share it (the all-tenants count and, since 926a3e9, the tenant's kept
jobs). Against a real Redis at REDIS_URL (flushed first), 200 jobs after 20 that set the sets' expiries.

    REDIS_URL=redis://... uv run --extra cpu --extra dev python -m bench.shared_commands {one,shared}

Run it with PYTHONPATH at a worktree of another commit to count that commit's. Figures: bench/RESULTS-cpu.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from redis.asyncio import Redis

from common.jobs import JobOutcome, JobStatus
from common.queue import keys
from common.queue.claims import Claims
from common.queue.membership import WorkerInfo, heartbeat
from common.queue.placement import Admission, Dispatcher
from common.queue.records import JobStore
from common.settings import RoutingPolicy

JOBS, FIRST = 200, 20  # jobs counted, after FIRST that set the sets' expiries


async def count(queue_of: str) -> dict[str, float]:
    """Commands per job by name, for a queue of one tenant (`queue_of` "one") or shared ("shared")."""
    redis = Redis.from_url(os.environ["REDIS_URL"])
    await redis.flushdb()
    queue = keys.queue_name("solo")
    await heartbeat(redis, WorkerInfo(id="solo", queue=queue, model="m", max_jobs=2, max_branches=8,
                                      started_at=time.time()))
    dispatcher = Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=0.1)
    store = JobStore(redis, result_ttl=600)
    try:
        claims = Claims(redis, queue, "solo", 60.0, unseen_before=16.0)
    except TypeError:  # before d78aa41 a claim took no unseen_before
        claims = Claims(redis, queue, "solo", 60.0)  # type: ignore[call-arg]
    admission = Admission(tenant="alpha", shared_weight=2.0 if queue_of == "shared" else 0.0)

    async def one(n: int) -> None:
        placed = await dispatcher.place(f"job_{n}", "k", 60.0, {"status": "queued", "request_id": "r", "kind": "async"},
                                        600, b"{}", None, admission)
        assert placed.queue, placed
        claimed = await claims.claim(f"job_{n}.1")
        assert claimed is not None and claimed.started is not None
        assert await store.store(f"job_{n}.1", JobOutcome(status=JobStatus.succeeded, result={}), time.monotonic() + 5)

    for n in range(FIRST):
        await one(n)
    before = await redis.info("commandstats")
    for n in range(FIRST, FIRST + JOBS):
        await one(n)
    after = await redis.info("commandstats")
    await redis.aclose()
    per = {name[len("cmdstat_"):]: (stats["calls"] - before.get(name, {"calls": 0})["calls"]) / JOBS
           for name, stats in after.items()}
    return {name: calls for name, calls in sorted(per.items(), key=lambda kv: -kv[1]) if calls and name != "info"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queue_of", choices=["one", "shared"], help="a queue of one tenant, or shared by tenants")
    per = asyncio.run(count(parser.parse_args().queue_of))
    print(f"commands per job: {sum(per.values()):.1f}; by name: " + ", ".join(f"{k} {v:g}" for k, v in per.items()))


if __name__ == "__main__":
    main()
