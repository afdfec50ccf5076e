"""What the queue hop costs: the same prepared jobs evaluated directly (worker code in this
process, straight to the engine) and through the queue (Redis + arq + a real worker process,
completion pushed back), against the same engine, in the same run, interleaved.

    uv run --extra cpu --extra dev python -m bench.queue_latency [--engine scripted|cpu] [--requests 200]
        [--poll-delay 0.5] [--no-wakeups] [--trace 100] [--awake-cores]

Prints p50/p99 per path and the difference at concurrency 1 and 16, then what the worker costs while
idle (its look at the queue and arq's poll of aborts every poll_delay, heartbeats, health probes): CPU
of the worker process and of Redis over 10 s with no job. `--no-wakeups` leaves the worker to its look at
the queue alone (OPENJEV_WORKER_WAKEUPS=false).
`--trace N` then follows N more jobs at concurrency 1 through Redis's MONITOR and prints where each one's
time went, stage by stage, on Redis's clock (MONITOR itself slows Redis a little; the hop above is measured
without it). `--awake-cores` runs the measurements (not the idle figure) beside one nice-19 busy loop per
core, so no core halts while a process waits (bench/awake.py).
Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from redis.asyncio import Redis

from api.preparation import JobPreparer
from api.queue_client import CompletionWaiter, JobQueue
from bench.awake import awake_cores
from common.contract import EXAMPLE_REQUEST, SystemOneRequest
from common.prompt import PromptCompiler
from common.queue import keys
from common.queue.membership import live_workers
from common.queue.records import JobStore
from common.redis_connection import redis_connection
from common.settings import Settings
from common.tokenizer import load_tokenizer
from harness.processes import start_cpu_engine, start_scripted_engine, start_worker
from harness.procfs import cpu_seconds
from harness.stacks import model_cache_dir
from openjev.embedded_redis import start_redis
from worker.branch_slots import BranchSlots
from worker.engine_client import EngineClient
from worker.evaluation import JobExecution


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(concurrency: int, requests: int, run_one) -> list[float]:
    """Latencies (ms) of `requests` calls of `run_one`, `concurrency` at a time."""
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def timed() -> None:
        async with gate:
            started = time.perf_counter()
            await run_one()
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(timed() for _ in range(requests)))
    return latencies


@contextlib.asynccontextmanager
async def queue_client(redis_url: str) -> AsyncIterator[JobQueue]:
    """What POST /v1/systemone places jobs with: a JobQueue with its completion waiter, closed after."""
    redis = redis_connection(Settings(_env_file=None, redis_url=redis_url))  # type: ignore[call-arg]
    waiter = CompletionWaiter(redis)
    await waiter.start()
    queue = JobQueue(redis, JobStore(redis, 600), waiter)
    try:
        yield queue
    finally:
        await queue.close()
        await waiter.stop()
        await redis.aclose()


async def bench(engine_url: str, redis_url: str, settings: Settings, preparer: JobPreparer, requests: int) -> list[str]:
    async with queue_client(redis_url) as queue:
        return await _bench(engine_url, queue, settings, preparer, requests)


async def _bench(engine_url: str, queue: JobQueue, settings: Settings, preparer: JobPreparer,
                 requests: int) -> list[str]:
    engine = EngineClient(engine_url, max_connections=128)
    slots = BranchSlots(settings.max_concurrent_branches)
    request = SystemOneRequest.model_validate(EXAMPLE_REQUEST)

    direct_engine: list[float] = []  # seconds of engine calls (warm, then branches) per direct job

    async def direct() -> None:
        job = preparer.prepare(request, "req_bench", 60)
        evaluation = await JobExecution(job, engine, slots).run()
        direct_engine.append(evaluation.prefill_seconds + evaluation.branches_seconds)

    stages: list[tuple[float, float, float, float]] = []  # (to the worker, worker besides the engine, back, engine) s

    async def queued() -> None:
        job = preparer.prepare(request, "req_bench", 60)
        submitted = time.time()
        outcome = await queue.run(job, 60)  # what POST /v1/systemone does after preparing
        answered = time.time()
        assert outcome is not None and outcome.result is not None
        t = outcome.timings
        picked = job.created_at + t.queue
        stages.append((picked - submitted, outcome.finished_at - picked - t.prefill - t.branches,
                       answered - outcome.finished_at, t.prefill + t.branches))

    while not await live_workers(queue.redis):
        await asyncio.sleep(0.2)
    for _ in range(5):  # warm both paths (connections, engine cache)
        await direct()
        await queued()
    lines = ["| concurrency | path | p50 ms | p99 ms |", "|---|---|---|---|"]
    for concurrency in (1, 16):
        stages.clear()
        direct_engine.clear()
        direct_ms: list[float] = []
        queued_ms: list[float] = []
        for _ in range(4):  # interleave rounds so drift in machine load hits both paths alike
            direct_ms += await measure(concurrency, requests // 4, direct)
            queued_ms += await measure(concurrency, requests // 4, queued)
        for name, values in (("direct", direct_ms), ("queued", queued_ms)):
            lines.append(f"| {concurrency} | {name} | {percentile(values, 0.5):.2f} | {percentile(values, 0.99):.2f} |")
        added_p50 = percentile(queued_ms, 0.5) - percentile(direct_ms, 0.5)
        added_p99 = percentile(queued_ms, 0.99) - percentile(direct_ms, 0.99)
        lines.append(f"| {concurrency} | **queue adds** | {added_p50:+.2f} | {added_p99:+.2f} |")
        lines.append(f"| {concurrency} | mean of direct / queued | {statistics.mean(direct_ms):.2f}"
                     f" | {statistics.mean(queued_ms):.2f} |")
        if concurrency == 1:
            to_worker, in_worker, back, engine_calls = (statistics.median(s[i] for s in stages) * 1000
                                                        for i in range(4))
            breakdown = (f"where the hop goes at concurrency 1 (medians, clocks of one machine): submit + pickup "
                         f"{to_worker:.2f} ms, worker besides the engine {in_worker:.2f} ms, completion to the "
                         f"waiting request {back:.2f} ms; the engine calls themselves {engine_calls:.2f} ms in the "
                         f"worker against {statistics.median(direct_engine) * 1000:.2f} ms direct")
    await engine.close()
    return [*lines, "", breakdown]


TRACE_STAGES = [  # (name, the event that ends it); each starts where the one before ended
    ("the API places the job (serialise, send)", "placed"),
    ("placement script, to its wake-up", "woken"),
    ("wake-up delivered, worker sends its claim", "claim"),
    ("the claim script (arq's claim, then the record's start)", "claimed"),
    ("arq's run_job starts in the job's task", "read"),
    ("arq reads the job, evaluate runs it (engine calls), outcome", "store"),
    ("store script, to its notice", "notice"),
    ("notice delivered, the waiting request answers", "answered"),
]


def job_events(job_id: str, commands: list[tuple[float, str, str]]) -> dict[str, float]:
    """When each traced event of `job_id` happened: (time, client, command) as MONITOR reported them."""
    events: dict[str, float] = {}
    for at, client, command in commands:
        if job_id not in command:
            continue
        if "placed" not in events:
            events["placed"] = at
        elif client == "lua" and command.startswith("PUBLISH") and keys.WAKE_SUFFIX in command:
            events.setdefault("woken", at)
        elif client != "lua" and command.startswith("EVALSHA") and "claim" not in events:
            events["claim"] = at
        elif client == "lua" and command.startswith("SET arq:in-progress:"):
            events.setdefault("claimed", at)
        elif command.startswith("GET arq:job:"):
            events.setdefault("read", at)
        elif client != "lua" and command.startswith("EVALSHA") and "claimed" in events:
            events.setdefault("store", at)
        elif client == "lua" and command.startswith("PUBLISH " + keys.DONE_CHANNEL):
            events.setdefault("notice", at)
    return events


async def trace(redis_url: str, preparer: JobPreparer, jobs: int) -> list[str]:
    """`jobs` sync jobs one after another, followed through MONITOR: the median of each stage."""
    request = SystemOneRequest.model_validate(EXAMPLE_REQUEST)
    commands: list[tuple[float, str, str]] = []
    monitoring = Redis.from_url(redis_url)

    async def follow() -> None:
        async with monitoring.monitor() as monitor:
            async for command in monitor.listen():
                commands.append((command["time"], command["client_address"], command["command"]))

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.5)
    marks: list[tuple[str, float, float]] = []
    async with queue_client(redis_url) as queue:
        for _ in range(jobs):
            job = preparer.prepare(request, "req_trace", 60)
            submitted = time.time()
            await queue.run(job, 60)
            marks.append((job.id, submitted, time.time()))
    await asyncio.sleep(0.5)
    follower.cancel()
    await monitoring.aclose()
    durations: dict[str, list[float]] = {name: [] for name, _ in TRACE_STAGES}
    for job_id, submitted, answered in marks:
        events = job_events(job_id, commands) | {"answered": answered}
        if any(event not in events for _, event in TRACE_STAGES):
            continue  # a job whose trace is incomplete (MONITOR joined late) is left out
        previous = submitted
        for name, event in TRACE_STAGES:
            durations[name].append((events[event] - previous) * 1000)
            previous = events[event]
    followed = len(durations[TRACE_STAGES[0][0]])
    lines = [f"where a job's time goes at concurrency 1, {followed} of {jobs} jobs followed through MONITOR "
             "(medians, ms, Redis's clock and the bench's, one machine):", "",
             "| stage | median ms |", "|---|---|"]
    lines += [f"| {name} | {statistics.median(values):.2f} |" for name, values in durations.items() if values]
    if followed:
        total = statistics.median(answered - submitted for _, submitted, answered in marks) * 1000
        lines.append(f"| whole request (median) | {total:.2f} |")
    return lines


def idle_cost(worker_pid: int, redis_pid: int, seconds: float = 10.0) -> str:
    """CPU used by the idle worker and Redis over `seconds`, as a share of one core."""
    before = cpu_seconds(worker_pid), cpu_seconds(redis_pid)
    time.sleep(seconds)
    worker, redis = (cpu_seconds(p) - b for p, b in zip((worker_pid, redis_pid), before, strict=True))
    return (f"idle for {seconds:g} s: worker {1000 * worker / seconds:.1f} CPU-ms per second, "
            f"Redis {1000 * redis / seconds:.1f} CPU-ms per second")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["scripted", "cpu"], default="scripted")
    parser.add_argument("--requests", type=int, default=200, help="per path and concurrency")
    parser.add_argument("--poll-delay", type=float, default=Settings().worker_poll_delay,
                        help="the worker's OPENJEV_WORKER_POLL_DELAY (its look at the queue; arq's poll_delay), s")
    parser.add_argument("--wakeups", action=argparse.BooleanOptionalAction, default=True,
                        help="the worker's OPENJEV_WORKER_WAKEUPS (default on)")
    parser.add_argument("--awake-cores", action="store_true",
                        help="measure beside one nice-19 busy loop per core, so no core halts (bench/awake.py)")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="then follow N jobs through Redis's MONITOR, stage by stage (default 0: none)")
    args = parser.parse_args()

    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-bench-"))
    redis_process, redis_url = start_redis()
    if args.engine == "scripted":
        engine = start_scripted_engine(log_dir)
    else:
        engine = start_cpu_engine(log_dir, model_cache_dir())
    settings = Settings(redis_url=redis_url, tokenizer=str(model_dir))
    worker = start_worker(log_dir, {"OPENJEV_REDIS_URL": redis_url, "OPENJEV_TOKENIZER": str(model_dir),
                                    "OPENJEV_WORKER_POLL_DELAY": str(args.poll_delay),
                                    "OPENJEV_WORKER_WAKEUPS": str(args.wakeups).lower()}, engine.url or "", "bench-0")
    try:
        preparer = JobPreparer(settings, PromptCompiler.for_tokenizer(load_tokenizer(str(model_dir))))
        with awake_cores(args.awake_cores):
            lines = asyncio.run(bench(engine.url or "", redis_url, settings, preparer, args.requests))
        lines.append(idle_cost(worker.process.pid, redis_process.pid))
        if args.trace:
            with awake_cores(args.awake_cores):
                lines += ["", *asyncio.run(trace(redis_url, preparer, args.trace))]
    finally:
        worker.stop()
        engine.stop()
        redis_process.terminate()
    print(f"engine: {args.engine}; {args.requests} requests per path and concurrency; example request (3 questions);"
          f" worker poll delay {args.poll_delay:g} s, wake-ups {'on' if args.wakeups else 'off'}"
          f"{'; cores kept awake' if args.awake_cores else ''}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
