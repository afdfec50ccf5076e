"""A bounded chaos run: a steady load of mixed sync (/v1/systemone) and async (/v1/jobs, then GET
?wait=) requests on Redis + 2 reference CPU engines + 2 workers + the API, all on loopback, while
one worker is SIGKILLed midway and restarted with the same worker id.

    uv run --extra cpu --extra dev python -m bench.chaos [--requests N --duration S --seed K] [--engine scripted]

Prints requests sent, answered (200), 504, 529/503, other errors and lost: sent with no final
answer (a sync request without any HTTP response, an async job not terminal by its deadline plus
a margin). Lost must be 0; the exit status is 1 otherwise. Figures: bench/RESULTS-chaos.md.

The engine crash (issue 28): N async jobs accepted at once, then one engine SIGKILLed while its
worker runs one of them; every job must succeed (exit status 1 otherwise):

    uv run --extra cpu --extra dev python -m bench.chaos --fault engine [--jobs 50]           # 2 workers
    uv run --extra cpu --extra dev python -m bench.chaos --fault engine --serve [--jobs 50]   # openjev serve,
                                                         # restarted on the same Redis directory
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
from redis.asyncio import Redis

from common.queue import keys
from harness.processes import Proc, openjev, spawn, start_scripted_engine, start_worker, wait_http
from harness.stacks import model_cache_dir, stack_env
from harness.web import web
from openjev.embedded_redis import free_port, start_redis

REQUEST_TIMEOUT = 20.0  # the sync deadline: long enough to outlast a worker restart (lease ≤ 5 s)
JOB_TIMEOUT = 30.0
CRASH_JOB_TIMEOUT = 300.0  # --fault engine: the async deadline, room for 50 jobs queued on busy CPU engines
LOST_MARGIN = 15.0  # seconds past a deadline after which a request with no final answer is lost
START_TIMEOUT = 600.0
SCRIPTED_DELAY = 0.05  # seconds the scripted engine stalls each prompt
ENGINES = {"cpu": "2 reference CPU engines (SmolLM2-135M-Instruct, no compute delay)",
           "scripted": f"2 scripted engines ({SCRIPTED_DELAY * 1000:g} ms per prompt)"}

STATES = [
    "Hi, I was charged twice for my March invoice. Please refund one of the charges.",
    "The dashboard has been down since this morning and none of my reports load.",
    "Could you tell me whether the enterprise plan includes single sign-on?",
    "I love the new release, the export button saved me an hour today. Thanks!",
    "My password reset email never arrives; I checked the spam folder twice.",
    "We are a team of 40 and would like a quote for annual billing.",
    "Your app deleted my notes after the update. I want my money back now.",
    "Is there a way to change the language of the interface to French?",
]
QUESTIONS = [
    {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}},
    {"team": {"type": "choice", "instructions": "Which team should handle this?",
              "criteria": {"Billing": "Payments, invoices, refunds", "Technical": "Bugs, outages",
                           "Sales": "Pricing, plans"}}},
    {"anger": {"type": "score", "instructions": "How frustrated is the customer?",
               "criteria": ["Calm", "Frustrated", "Very angry"]},
     "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}},
]


@dataclass
class Tally:
    """Final answers by kind; `detail` says which status or error each non-200 was."""

    sent: int = 0
    answered: int = 0
    deadline: int = 0  # 504, or an async job that ended `expired`
    shed: int = 0  # 529 or 503 with Retry-After
    other: int = 0
    lost: int = 0
    latencies: list[float] = field(default_factory=list)
    detail: Counter[str] = field(default_factory=Counter)

    def count(self, kind: str, started: float, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind == "answered":
            self.latencies.append(time.monotonic() - started)
        else:
            self.detail[what] += 1


async def sync_request(client: httpx.AsyncClient, payload: dict, tally: Tally) -> None:
    started = time.monotonic()
    try:
        response = await client.post("/v1/systemone", json=payload, timeout=REQUEST_TIMEOUT + LOST_MARGIN)
    except httpx.HTTPError as exc:
        tally.count("lost", started, f"sync: no response ({type(exc).__name__})")
        return
    tally.count(_kind(response.status_code), started, f"sync {response.status_code}")


async def async_request(client: httpx.AsyncClient, payload: dict, tally: Tally) -> None:
    started = time.monotonic()
    give_up = started + JOB_TIMEOUT + LOST_MARGIN
    try:
        submitted = await client.post("/v1/jobs", json=payload, timeout=LOST_MARGIN)
    except httpx.HTTPError as exc:
        tally.count("lost", started, f"async submit: no response ({type(exc).__name__})")
        return
    if submitted.status_code != 202:
        tally.count(_kind(submitted.status_code), started, f"async submit {submitted.status_code}")
        return
    job_id = submitted.json()["id"]
    while time.monotonic() < give_up:
        try:
            view = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 10}, timeout=20)).json()
        except httpx.HTTPError:
            await asyncio.sleep(0.5)  # a failed poll is not a lost job: poll again until the margin
            continue
        status = view["status"]
        if status == "succeeded":
            tally.count("answered", started, status)
            return
        if status == "expired":
            tally.count("deadline", started, "async expired")
            return
        if status in ("failed", "cancelled"):
            error = view.get("error") or {}
            tally.count("other", started, f"async {status}: {error.get('error_type')}")
            return
    tally.count("lost", started, "async: not terminal by its deadline + margin")


def _kind(status: int) -> str:
    if status == 200:
        return "answered"
    if status == 504:
        return "deadline"
    if status in (503, 529):
        return "shed"
    return "other"


@dataclass
class Cluster:
    """The processes of the run; the env is what each worker gets."""

    redis_url: str
    engines: list[Proc]
    workers: dict[str, Proc]
    api: Proc
    env: dict[str, str]
    log_dir: Path

    retired: list[Proc] = field(default_factory=list)

    def restart(self, worker_id: str, engine_url: str) -> None:
        self.retired.append(self.workers[worker_id])
        self.workers[worker_id] = start_worker(self.log_dir, self.env, engine_url, worker_id)

    def recovery_log(self) -> list[str]:
        """What the workers logged about interrupted jobs: resumed under the same id, or moved."""
        lines = [line for proc in [*self.retired, *self.workers.values()] for line in proc.output().splitlines()]
        return [line.split(": ", 1)[-1] for line in lines if "resuming" in line or "moved" in line]

    async def wait_live(self, client: httpx.AsyncClient, worker_id: str) -> None:
        while True:
            try:
                workers = (await client.get("/health", timeout=5)).json()["workers"]
                if worker_id in {w["id"] for w in workers}:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        for proc in [self.api, *self.workers.values(), *self.engines]:
            proc.stop()


async def _wait_started_after(redis_url: str, worker_id: str, after: float) -> None:
    """Until a heartbeat of `worker_id` comes from a process started after `after` (epoch seconds)."""
    redis = Redis.from_url(redis_url)
    try:
        while True:
            raw = await redis.get(keys.worker_key(worker_id))
            if raw and orjson.loads(raw)["started_at"] > after:
                return
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


async def _queued(redis_url: str, worker_id: str, patience: float = 10.0) -> int:
    """Once the worker holds a job (or `patience` runs out): the jobs in its queue, running ones included."""
    redis = Redis.from_url(redis_url)
    give_up = time.monotonic() + patience
    try:
        while not (queued := int(await redis.zcard(keys.queue_name(worker_id)))) and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        return queued
    finally:
        await redis.aclose()


async def engine_prompts(client: httpx.AsyncClient, engine_url: str) -> int:
    """The prompts an engine holds now: the CPU engine's queue depth, the scripted one's live requests."""
    stats = (await client.get(f"{engine_url}/stats", timeout=5)).json()
    return stats.get("queue_depth", 0) or len(stats.get("live", []))


def start_engine(kind: str, index: int, log_dir: Path) -> Proc:
    """A CPU engine (the real model, no compute delay) or a scripted one stalling each prompt."""
    if kind == "scripted":
        engine = start_scripted_engine(log_dir)
        web.post(f"{engine.url}/script", json={"delay": SCRIPTED_DELAY}, timeout=5).raise_for_status()
        return engine
    port = free_port()
    engine = spawn(f"chaos-engine-{index}", openjev("engine", "--port", str(port), "--cache-dir",
                                                     str(model_cache_dir())), {}, log_dir)
    engine.url = f"http://127.0.0.1:{port}"
    return engine


def start_cluster(engine_kind: str, log_dir: Path, job_timeout: float = JOB_TIMEOUT
                  ) -> tuple[Cluster, subprocess.Popen[bytes]]:
    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    redis_process, redis_url = start_redis()
    env = stack_env(redis_url, model_dir, OPENJEV_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT),
                    OPENJEV_JOB_TIMEOUT=str(job_timeout))
    engines = [start_engine(engine_kind, i, log_dir) for i in range(2)]
    api_port = free_port()
    api = spawn("chaos-api", openjev("api", "--port", str(api_port)), env, log_dir)
    api.url = f"http://127.0.0.1:{api_port}"
    for engine in engines:
        wait_http(engine, f"{engine.url}/health", START_TIMEOUT)
    workers = {f"chaos-{i}": start_worker(log_dir, env, engine.url or "", f"chaos-{i}")
               for i, engine in enumerate(engines)}
    wait_http(api, f"{api.url}/health", START_TIMEOUT)
    return Cluster(redis_url, engines, workers, api, env, log_dir), redis_process


async def run(cluster: Cluster, requests: int, duration: float, seed: int, kill_at: float) -> tuple[Tally, list[str]]:
    rng = random.Random(seed)
    tally = Tally()
    events: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=cluster.api.url or "", limits=limits) as client:
        for worker_id in cluster.workers:
            await cluster.wait_live(client, worker_id)
        for state in STATES[:2]:  # teach the workers their job time before the clock starts
            await client.post("/v1/systemone", json={"model": "jev-latest", "state": state, "questions": QUESTIONS[0]},
                              timeout=REQUEST_TIMEOUT)
        victim = rng.choice(sorted(cluster.workers))
        plan = [(rng.choice([sync_request, async_request]),
                 {"model": "jev-latest", "state": rng.choice(STATES), "questions": rng.choice(QUESTIONS)})
                for _ in range(requests)]
        victim_engine = cluster.engines[sorted(cluster.workers).index(victim)].url or ""
        began = time.monotonic()

        async def chaos() -> None:
            await asyncio.sleep(kill_at * duration)
            queued = await _queued(cluster.redis_url, victim)
            async with httpx.AsyncClient() as engine_client:
                prompts = await engine_prompts(engine_client, victim_engine)
            cluster.workers[victim].kill()
            killed_at = time.time()
            events.append(f"{time.monotonic() - began:5.1f} s  SIGKILL {victim} with {prompts} prompt(s) at its "
                          f"engine and {queued} job(s) in its queue (running included); restarted at once with "
                          "the same id")
            cluster.restart(victim, victim_engine)
            await _wait_started_after(cluster.redis_url, victim, killed_at)
            events.append(f"{time.monotonic() - began:5.1f} s  {victim}'s new process heartbeats (it took the lease "
                          "once the dead one's lapsed)")

        async def one(i: int, send, payload: dict) -> None:
            await asyncio.sleep(max(0.0, began + i * duration / requests - time.monotonic()))
            tally.sent += 1
            await send(client, payload, tally)

        chaos_task = asyncio.create_task(chaos())
        await asyncio.gather(*(one(i, send, payload) for i, (send, payload) in enumerate(plan)))
        await chaos_task
        events.append(f"{time.monotonic() - began:5.1f} s  every request has a final answer or is counted lost")
    return tally, events + [f"worker log: {line}" for line in cluster.recovery_log()]


def report(tally: Tally, events: list[str], args: argparse.Namespace) -> str:
    latencies = sorted(tally.latencies)

    def pct(q: float) -> str:
        return f"{latencies[min(len(latencies) - 1, round(q * (len(latencies) - 1)))]:.2f}" if latencies else "-"

    lines = [
        f"{args.requests} requests over {args.duration:g} s (seed {args.seed}), half sync, half async; "
        f"{ENGINES[args.engine]}, 2 workers, 1 API; "
        f"sync deadline {REQUEST_TIMEOUT:g} s, async {JOB_TIMEOUT:g} s",
        "",
        "| sent | answered (200) | 504 | 529/503 | other errors | lost |",
        "|---|---|---|---|---|---|",
        f"| {tally.sent} | {tally.answered} | {tally.deadline} | {tally.shed} | {tally.other} | {tally.lost} |",
        "",
        f"answered latency: p50 {pct(0.5)} s, p99 {pct(0.99)} s, max {pct(1.0)} s",
        *(f"not answered: {what}: {n}" for what, n in sorted(tally.detail.items())),
        "",
        *events,
    ]
    return "\n".join(lines)


async def accept(client: httpx.AsyncClient, count: int) -> list[str]:
    """`count` async jobs (seeded mix of states and questions), all accepted (202)."""
    rng = random.Random(count)
    jobs = []
    for i in range(count):
        payload = {"model": "jev-latest", "state": f"{rng.choice(STATES)} (ticket {i})",
                   "questions": rng.choice(QUESTIONS)}
        submitted = await client.post("/v1/jobs", json=payload, timeout=30)
        assert submitted.status_code == 202, submitted.text
        jobs.append(submitted.json()["id"])
    return jobs


async def outcomes(client: httpx.AsyncClient, jobs: list[str], patience: float) -> Counter[str]:
    """How each job ended ("succeeded", "failed: engine_error", ..., or "pending" past `patience` s)."""
    give_up = time.monotonic() + patience

    async def one(job_id: str) -> str:
        while time.monotonic() < give_up:
            try:
                view = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 10}, timeout=20)).json()
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if view["status"] not in ("queued", "running"):
                error = (view.get("error") or {}).get("error_type")
                ran = view.get("attempts", 1)
                return view["status"] + (f": {error}" if error else "") + (f" (attempts {ran})" if ran > 1 else "")
        return "pending"

    return Counter(await asyncio.gather(*(one(job_id) for job_id in jobs)))


async def until_in_flight(engine_url: str) -> int:
    """Once the engine holds a prompt: how many it holds."""
    async with httpx.AsyncClient() as client:
        while not (prompts := await engine_prompts(client, engine_url)):
            await asyncio.sleep(0.02)
    return prompts


async def engine_crash_in_fleet(cluster: Cluster, count: int) -> tuple[Counter[str], list[str]]:
    """Accept `count` jobs on 2 workers, SIGKILL chaos-0's engine while it works; every job's ending."""
    async with httpx.AsyncClient(base_url=cluster.api.url or "") as client:
        for worker_id in cluster.workers:
            await cluster.wait_live(client, worker_id)
        began = time.monotonic()
        jobs = await accept(client, count)
        events = [f"{time.monotonic() - began:5.1f} s  {count} jobs accepted (202)"]
        prompts = await until_in_flight(cluster.engines[0].url or "")
        queued = await _queued(cluster.redis_url, "chaos-0")
        cluster.engines[0].kill()
        events.append(f"{time.monotonic() - began:5.1f} s  SIGKILL chaos-0's engine with {prompts} prompt(s) in it "
                      f"and {queued} job(s) in chaos-0's queue, running ones included; nothing restarted")
        ended = await outcomes(client, jobs, CRASH_JOB_TIMEOUT + LOST_MARGIN)
        events.append(f"{time.monotonic() - began:5.1f} s  every job ended")
    code = cluster.workers["chaos-0"].process.wait(60)
    events.append(f"chaos-0 exited with {code} (its engine is down)")
    lines = [line for proc in cluster.workers.values() for line in proc.output().splitlines()]
    events += [f"worker log: {n} x 'runs again' (engine failures), {sum('moved' in line for line in lines)} x moved"
               for n in [sum("runs again" in line for line in lines)]]
    return ended, events


async def engine_crash_under_serve(count: int, log_dir: Path) -> tuple[Counter[str], list[str]]:
    """Accept `count` jobs on `openjev serve` (1 worker, CPU engine), SIGKILL its engine while it works,
    then start serve again on the same Redis directory, as its platform would; every job's ending."""
    import os
    import signal

    from tests.test_faults import child, port_of, start_serve, stop_serve

    redis_dir = str(log_dir / "redis")
    began = time.monotonic()
    first = start_serve(log_dir, OPENJEV_REDIS_DIR=redis_dir)
    events = [f"{time.monotonic() - began:5.1f} s  serve ready"]
    try:
        engine_pid, engine_cmd = child(first.process, "engine")
        async with httpx.AsyncClient(base_url=first.url) as client:
            jobs = await accept(client, count)
        events.append(f"{time.monotonic() - began:5.1f} s  {count} jobs accepted (202)")
        await until_in_flight(f"http://127.0.0.1:{port_of(engine_cmd)}")
        os.kill(engine_pid, signal.SIGKILL)
        events.append(f"{time.monotonic() - began:5.1f} s  SIGKILL the engine")
        code = first.process.wait(120)
        events.append(f"{time.monotonic() - began:5.1f} s  serve exited with {code}")
    finally:
        stop_serve(first)
    second = start_serve(log_dir, OPENJEV_REDIS_DIR=redis_dir)
    events.append(f"{time.monotonic() - began:5.1f} s  serve restarted on the same Redis directory, ready")
    try:
        async with httpx.AsyncClient(base_url=second.url) as client:
            ended = await outcomes(client, jobs, 600)
        events.append(f"{time.monotonic() - began:5.1f} s  every job ended")
    finally:
        stop_serve(second)
    return ended, events


def engine_crash(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-chaos-"))
    shape = "openjev serve (1 worker, CPU engine)" if args.serve else f"{ENGINES[args.engine]}, 2 workers, 1 API"
    print(f"engine crash: {args.jobs} async jobs on {shape} (logs in {log_dir})", flush=True)
    if args.serve:
        ended, events = asyncio.run(engine_crash_under_serve(args.jobs, log_dir))
    else:
        cluster, redis_process = start_cluster(args.engine, log_dir, CRASH_JOB_TIMEOUT)
        try:
            ended, events = asyncio.run(engine_crash_in_fleet(cluster, args.jobs))
        finally:
            cluster.stop()
            redis_process.terminate()
    succeeded = sum(n for ending, n in ended.items() if ending.startswith("succeeded"))
    print(f"succeeded {succeeded}/{args.jobs}")
    print("\n".join([*(f"  {ending}: {n}" for ending, n in sorted(ended.items())), *events]))
    return 0 if succeeded == args.jobs else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="requests sent in all (default 60)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds the load lasts (default 60)")
    parser.add_argument("--seed", type=int, default=1,
                        help="picks each request's kind, state and questions, and the victim")
    parser.add_argument("--kill-at", type=float, default=0.35, help="fraction of the duration at which to kill")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="cpu", help="default: cpu")
    parser.add_argument("--fault", choices=["worker", "engine"], default="worker",
                        help="worker: SIGKILL a worker under steady load (default); engine: SIGKILL an engine "
                        "with --jobs async jobs accepted")
    parser.add_argument("--jobs", type=int, default=50, help="--fault engine: async jobs accepted (default 50)")
    parser.add_argument("--serve", action="store_true",
                        help="--fault engine: under `openjev serve` with one worker, restarted on the same Redis")
    args = parser.parse_args()
    if args.fault == "engine":
        return engine_crash(args)
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-chaos-"))
    print(f"starting Redis, {ENGINES[args.engine]}, 2 workers and the API (logs in {log_dir})", flush=True)
    cluster, redis_process = start_cluster(args.engine, log_dir)
    try:
        tally, events = asyncio.run(run(cluster, args.requests, args.duration, args.seed, args.kill_at))
    finally:
        cluster.stop()
        redis_process.terminate()
    print(report(tally, events, args))
    return 0 if tally.lost == 0 and tally.sent == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
