"""What a request costs in CPU, per process of the stack (API, worker, Redis; the engine is a zero-cost
scripted one and is left out), and how many requests per second one stack serves: this checkout against
a baseline commit (today's path: one /generate call per branch, stdlib JSON, per-token prefix hashing),
each a full stack of real processes, measured in the same run with rounds interleaved so that drift in the
machine's load hits both alike. Medians of the rounds; ratios are new / baseline.

    uv run --extra cpu --extra dev python -m bench.cpu_cost [--baseline REV] [--rounds 3] [--unbatched]
        [--only "64 questions"] [--only "README example, c=16"]
    uv run --extra cpu --extra dev python -m bench.cpu_cost --idle-floor [--rounds 3] [--idle-seconds 20]
        [--awake-cores]

Scenarios: the README example at concurrency 1, 16 and 64; 1/4/16/64 questions and 100/1000/8000-token
states at concurrency 16 (per-question and per-1k-state-token slopes from them); and each stack at rest.
The baseline runs from a temporary `git worktree` of REV in an environment synced from REV's own
pyproject.toml; `--unbatched` adds this checkout with one engine call per branch. Besides CPU, each
sample counts the engine's /generate calls, Redis's commands (INFO commandstats) and its round trips (the
requests it read, INFO stats `total_reads_processed`: a pipeline or a script call is one) per request, and
the report gives each scenario's spread across rounds (largest / smallest total CPU).
Figures: bench/RESULTS-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import uvloop

from bench.awake import awake_cores
from common.contract import EXAMPLE_REQUEST
from harness.procfs import cpu_seconds, run_seconds, wakeups
from harness.stacks import model_cache_dir
from harness.web import web
from openjev.embedded_redis import SERVE_HZ, free_port, start_redis
from worker.engine_http import EngineHttp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "3c3aab0"  # main before batched branch calls (2026-12-01)
MEASURED = ("api", "worker", "redis")
RETRIES_503 = 20
retried_503: dict[str, int] = {}  # per stack URL: requests answered 503 and sent again
failed: dict[str, int] = {}  # per stack URL: requests that ended without a 200


@dataclass
class Stack:
    """One full openjev (Redis, scripted engine, worker, API) running the code in `root`."""

    name: str
    root: Path
    python: str  # the interpreter of the environment the stack's code runs in
    env: dict[str, str] = field(default_factory=dict)  # settings of this stack only
    redis_hz: int | None = None  # Redis's `hz` (its background timer), set after it starts; None: serve's (1)
    url: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    engine_url: str = ""
    redis_url: str = ""


@dataclass(frozen=True)
class Scenario:
    name: str
    body: dict
    concurrency: int
    requests: int
    questions: int
    state_tokens: int | None = None
    path: str = "/v1/systemone"  # or "/v1/jobs": an async job, submitted and then awaited (GET ?wait=)


@dataclass
class Sample:
    """One measured run of a scenario on a stack."""

    cpu_ms: dict[str, float]  # CPU-ms per request, per process
    rps: float
    engine_calls: float = 0.0  # /generate calls per request (warm and branch calls)
    redis_commands: float = 0.0  # Redis commands per request, every client's (INFO commandstats)
    redis_round_trips: float = 0.0  # requests Redis read per request, every client's (a pipeline or script: one)
    redis_by_command: dict[str, float] = field(default_factory=dict)  # `redis_commands` by command name

    @property
    def total(self) -> float:
        return sum(self.cpu_ms.values())


def spawn(root: Path, log_dir: Path, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a process with `root` first on its import path (python -m imports from the working directory)."""
    log = (log_dir / f"{name}.log").open("wb")
    return subprocess.Popen(argv, cwd=root, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            if web.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout} s")


@contextmanager
def running_stack(stack: Stack, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    processes: list[subprocess.Popen[bytes]] = []
    redis, redis_url = start_redis()
    processes.append(redis)
    try:
        if stack.redis_hz is not None:
            import redis as redis_client

            with redis_client.Redis.from_url(redis_url) as client:
                client.config_set("hz", stack.redis_hz)
        engine_port, api_port = free_port(), free_port()
        engine = spawn(ROOT, log_dir, f"{stack.name}-engine",
                       [sys.executable, "-m", "harness.scripted_engine", "--port", str(engine_port)], {})
        processes.append(engine)
        wait_ready(f"http://127.0.0.1:{engine_port}/health", engine)
        env = {"OPENJEV_REDIS_URL": redis_url, "OPENJEV_TOKENIZER": str(model_dir),
               "OPENJEV_SERVED_MODEL_NAME": "HuggingFaceTB/SmolLM2-135M-Instruct", "OPENJEV_LOG_LEVEL": "WARNING",
               "OPENJEV_CACHE_DIR": str(model_cache_dir().parent), "OPENJEV_REQUEST_TIMEOUT": "300", **stack.env}
        worker = spawn(stack.root, log_dir, f"{stack.name}-worker", [stack.python, "-m", "openjev", "worker"],
                       {**env, "OPENJEV_ENGINE_URL": f"http://127.0.0.1:{engine_port}",
                        "OPENJEV_WORKER_ID": f"{stack.name}-0"})
        processes.append(worker)
        api = spawn(stack.root, log_dir, f"{stack.name}-api",
                    [stack.python, "-m", "openjev", "api", "--port", str(api_port)], env)
        processes.append(api)
        stack.url = f"http://127.0.0.1:{api_port}"
        wait_ready(f"{stack.url}/health", api)
        stack.pids = {"api": api.pid, "worker": worker.pid, "redis": redis.pid}
        stack.engine_url, stack.redis_url = f"http://127.0.0.1:{engine_port}", redis_url
        yield stack
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


@contextmanager
def git_worktree(revision: str) -> Iterator[Path]:
    """A temporary `git worktree` of `revision`, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="openjev-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)


@contextmanager
def baseline_checkout(revision: str) -> Iterator[Path]:
    """A temporary worktree of `revision` with its own environment, synced from its own pyproject.toml (so
    it has exactly the dependencies that revision declared: no `sniffio` for today's path); removed
    afterwards. The API and worker need no torch; the scripted engine runs from this checkout."""
    with git_worktree(revision) as path:
        subprocess.run(["uv", "sync", "--project", str(path), "--no-dev", "--quiet"], check=True,
                       env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(path / ".venv")})
        yield path


async def load(url: str, body: dict, concurrency: int, requests: int, path: str = "/v1/systemone") -> float:
    """Send `requests` copies of `body` to `path`, `concurrency` at a time; returns the wall seconds. An async
    job (`path` "/v1/jobs") is awaited with `GET /v1/jobs/{id}?wait=` until it ends. The client is the
    worker's own HTTP/1.1 pool (worker/engine_http.py), a tenth of httpx's CPU per call: with httpx, 64
    callers took most of a core on this 2-vCPU machine, and the stacks measured competed with it."""
    client = EngineHttp(url, max_connections=concurrency)
    payload = orjson.dumps(body)
    remaining = iter(range(requests))

    async def awaited(job_id: str) -> tuple[int, bytes | None]:
        """An accepted job's end: 200 once it succeeded, 500 when it ended otherwise, or the status of a GET
        that failed."""
        while True:
            status, answer = await client.request("GET", f"/v1/jobs/{job_id}?wait=30", 300)
            if status != 200 or answer is None:
                return status, answer
            ended = orjson.loads(answer)["status"]
            if ended not in ("queued", "running"):
                return (200 if ended == "succeeded" else 500), answer

    async def caller() -> None:
        for _ in remaining:
            for _attempt in range(RETRIES_503):
                status, answer = await client.request("POST", path, 300, payload)
                if status != 503:
                    break
                # On an overloaded machine the baseline's worker may miss a heartbeat while its
                # engine health check waits (fixed since); retry rather than abort the run.
                retried_503[url] = retried_503.get(url, 0) + 1
                await asyncio.sleep(0.5)
            if status == 202 and answer is not None:
                status, answer = await awaited(orjson.loads(answer)["id"])
            if status != 200:  # counted and reported; one failure must not lose the run
                failed[url] = failed.get(url, 0) + 1
                print(f"{url}: {status} {(answer or b'')[:300]!r}", file=sys.stderr)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    finally:
        await client.aclose()
    return time.perf_counter() - started


def engine_calls(stack: Stack) -> int:
    return web.get(f"{stack.engine_url}/stats", timeout=30).json()["generate_calls"]


def redis_counts(stack: Stack) -> tuple[dict[str, int], int]:
    """Commands Redis has run since it started, by name, those a script runs included (INFO commandstats),
    and the requests it has read from its clients, a pipeline or a script call one each: its round trips
    (INFO stats `total_reads_processed`). The INFO that asks counts in both."""
    import redis as redis_client

    with redis_client.Redis.from_url(stack.redis_url) as client:
        commands = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in client.info("commandstats").items()}
        return commands, int(client.info("stats")["total_reads_processed"])


def measure(stack: Stack, scenario: Scenario) -> Sample:
    calls_before, (commands_before, reads_before) = engine_calls(stack), redis_counts(stack)
    before = {name: cpu_seconds(pid) for name, pid in stack.pids.items()}
    wall = uvloop.run(load(stack.url, scenario.body, scenario.concurrency, scenario.requests, scenario.path))
    after = {name: cpu_seconds(pid) for name, pid in stack.pids.items()}
    cpu = {name: (after[name] - before[name]) * 1000 / scenario.requests for name in MEASURED}
    calls = (engine_calls(stack) - calls_before) / scenario.requests
    commands_after, reads_after = redis_counts(stack)
    by_command = {name: (calls - commands_before.get(name, 0) - 2 * (name == "info")) / scenario.requests
                  for name, calls in commands_after.items()}  # less the two INFOs before
    by_command = {name: count for name, count in by_command.items() if count > 0}
    round_trips = (reads_after - reads_before - 2) / scenario.requests
    return Sample(cpu, scenario.requests / wall, calls, sum(by_command.values()), round_trips, by_command)


def at_rest(pids: dict[str, int], seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """CPU-ms per second and wake-ups per second of each named process over the next `seconds`."""
    before = {name: (run_seconds(pid), wakeups(pid)) for name, pid in pids.items()}
    time.sleep(seconds)
    cpu = {name: (run_seconds(pid) - before[name][0]) * 1000 / seconds for name, pid in pids.items()}
    woken = {name: (wakeups(pid) - before[name][1]) / seconds for name, pid in pids.items()}
    return cpu, woken


def cpu_ms_per_second(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU-ms per second of each named process over the next `seconds`."""
    return at_rest(pids, seconds)[0]


def idle_ms_per_second(stack: Stack, seconds: float) -> dict[str, float]:
    return cpu_ms_per_second({name: stack.pids[name] for name in MEASURED}, seconds)


async def noop_app(scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
                   ) -> None:
    """An ASGI app that does nothing: uvicorn's own cost at rest (`--idle-floor`)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


QUIET_SERVER = ("import sys\nfrom api import server\nfrom bench.cpu_cost import noop_app\n"
                "server.run(noop_app, port=int(sys.argv[1]), log_level='warning')")
TICKING_LOOP = ("import asyncio\nasync def main():\n    while True:\n        await asyncio.sleep(0.1)\n"
                "asyncio.run(main())")


def idle_floor(model_dir: Path, log_dir: Path, rounds: int, seconds: float, awake: bool = False) -> list[str]:
    """This checkout at rest, with its Redis's timer and liveness trimmed, beside what a bare
    uvicorn, the API's server and a bare asyncio loop waking ten times a second cost on this machine; with `awake`, each
    window is measured beside one nice-19 busy loop per core (bench/awake.py)."""
    poll, probe = {"OPENJEV_WORKER_POLL_DELAY": "5"}, {"OPENJEV_ENGINE_HEALTH_INTERVAL": "5"}
    variants = [Stack("this checkout, Redis hz 1 (serve's Redis)", ROOT, sys.executable, redis_hz=SERVE_HZ),
                Stack("this checkout, Redis hz 10 (Redis's default, as compose and deploy run it)", ROOT,
                      sys.executable, redis_hz=10),
                Stack("arq poll 5 s (default 4), hz 1", ROOT, sys.executable, poll, redis_hz=SERVE_HZ),
                Stack("engine probe every 5 s (default 2), hz 1", ROOT, sys.executable, probe, redis_hz=SERVE_HZ),
                Stack("poll and probe 5 s, hz 1", ROOT, sys.executable, {**poll, **probe}, redis_hz=SERVE_HZ)]
    lines = ["| at rest | API | worker | Redis | total CPU-ms per second | wake-ups per second (API, worker, Redis) "
             "| CPU-ms per wake-up |", "|---|---|---|---|---|---|---|"]
    for stack in variants:
        with running_stack(stack, model_dir, log_dir) as running:
            time.sleep(3)  # past start-up
            with awake_cores(awake):
                found = [at_rest({name: running.pids[name] for name in MEASURED}, seconds) for _ in range(rounds)]
        rest = {name: statistics.median(cpu[name] for cpu, _ in found) for name in MEASURED}
        woken = {name: statistics.median(w[name] for _, w in found) for name in MEASURED}
        lines.append(f"| {stack.name} | {rest['api']:.2f} | {rest['worker']:.2f} | {rest['redis']:.2f} | "
                     f"{sum(rest.values()):.2f} | {sum(woken.values()):.1f} ({woken['api']:.1f}, "
                     f"{woken['worker']:.1f}, {woken['redis']:.1f}) | {_per(rest, woken)} |")
        print(lines[-1], file=sys.stderr, flush=True)
    port = free_port()
    for name, argv in (("a bare uvicorn (no-op app)", [sys.executable, "-m", "uvicorn", "bench.cpu_cost:noop_app",
                                                       "--port", str(port), "--log-level", "warning"]),
                       ("the API's server (api/server.py, no-op app)", [sys.executable, "-c", QUIET_SERVER, str(port)]),
                       ("a bare asyncio loop waking every 0.1 s", [sys.executable, "-c", TICKING_LOOP])):
        process = spawn(ROOT, log_dir, "floor", argv, {})
        try:
            time.sleep(3)
            with awake_cores(awake):
                found = [at_rest({name: process.pid}, seconds) for _ in range(rounds)]
        finally:
            process.terminate()
            process.wait(10)
        cpu, woken = (statistics.median(f[i][name] for f in found) for i in (0, 1))
        lines.append(f"| {name} | {cpu:.2f} | | | {cpu:.2f} | {woken:.1f} | {_per({name: cpu}, {name: woken})} |")
    lines.append("")
    lines.append(f"medians of {rounds} windows of {seconds:g} s; CPU from /proc/PID/task/*/schedstat (ns)"
                 + ("; every core kept awake by a nice-19 busy loop" if awake else ""))
    return lines


def _per(cpu: dict[str, float], woken: dict[str, float]) -> str:
    total = sum(woken.values())
    return f"{sum(cpu.values()) / total:.2f}" if total else "–"


def noul_questions(count: int) -> dict:
    return {f"q{i}": {"type": "noul", "instructions": f"Does the customer mention problem number {i}?"}
            for i in range(count)}


def state_of(tokens: int, tokenizer_dir: Path) -> str:
    """A conversation state of about `tokens` tokens in the served model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sentence = "The customer says the parcel arrived late and the box was damaged on one side. "
    per_sentence = len(tokenizer.encode(sentence))
    return sentence * max(1, round(tokens / per_sentence))


def scenarios(model_dir: Path, scale: float) -> list[Scenario]:
    """The workloads, with `scale` times their default number of requests."""

    def n(count: int) -> int:
        return max(4, int(count * scale))

    example = dict(EXAMPLE_REQUEST)
    found = [Scenario(f"README example, c={c}", example, c, n(count), len(example["questions"]))
             for c, count in ((1, 24), (16, 64), (64, 128))]
    found.append(Scenario("README example as async jobs, c=16", example, 16, n(64), len(example["questions"]),
                          path="/v1/jobs"))
    for questions, count in ((1, 64), (4, 48), (16, 32), (64, 16)):
        body = {"model": "jev-latest", "state": "I was charged twice for one order.",
                "questions": noul_questions(questions)}
        found.append(Scenario(f"{questions} questions, c=16", body, 16, n(count), questions))
    for tokens, count in ((100, 48), (1000, 32), (8000, 16)):
        body = {"model": "jev-latest", "state": state_of(tokens, model_dir), "questions": example["questions"]}
        found.append(Scenario(f"{tokens}-token state, c=16", body, 16, n(count), len(example["questions"]),
                              tokens))
    return found


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mean_x = statistics.mean(x for x, _ in points)
    mean_y = statistics.mean(y for _, y in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def median_sample(samples: list[Sample]) -> Sample:
    cpu = {name: statistics.median(s.cpu_ms[name] for s in samples) for name in MEASURED}
    names = {name for s in samples for name in s.redis_by_command}
    by_command = {name: statistics.median(s.redis_by_command.get(name, 0.0) for s in samples) for name in names}
    return Sample(cpu, statistics.median(s.rps for s in samples), statistics.median(s.engine_calls for s in samples),
                  statistics.median(s.redis_commands for s in samples),
                  statistics.median(s.redis_round_trips for s in samples), by_command)


def commands_by_name(sample: Sample) -> str:
    """The Redis commands a request costs, by name, most first (those of under 0.05 a request left out)."""
    named = sorted(sample.redis_by_command.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{name} {count:.1f}" for name, count in named if count >= 0.05)


def spread(samples: list[Sample]) -> str:
    """Largest / smallest total CPU across the rounds, with the range of engine calls per request."""
    totals = [s.total for s in samples]
    calls = [s.engine_calls for s in samples]
    return f"{max(totals) / min(totals):.2f}× ({min(calls):.1f}-{max(calls):.1f} calls)" if min(totals) else "–"


def paired_ratio(rounds: list[Sample], baseline_rounds: list[Sample]) -> str:
    """The median of each round's ratio to the baseline's run in the same round, with their range: each
    round runs the two stacks back to back, so a drift of the machine's speed between rounds (a shared
    host's neighbours) cancels out of each pair, where it stays in the ratio of the two medians."""
    ratios = sorted(a.total / b.total for a, b in zip(rounds, baseline_rounds, strict=True) if b.total)
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def report(stacks: list[Stack], results: dict[tuple[str, str], list[Sample]], found: list[Scenario],
           idle: dict[str, list[dict[str, float]]]) -> list[str]:
    base, new = stacks[0].name, stacks[-1].name
    lines = ["| scenario | stack | API | worker | Redis | total CPU-ms/request | requests/s | total ratio "
             "| paired ratio | engine calls/request | Redis commands/request | Redis round trips/request "
             "| spread across rounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    medians = {key: median_sample(samples) for key, samples in results.items()}
    for scenario in found:
        reference = medians[(scenario.name, base)].total
        for stack in stacks:
            m = medians[(scenario.name, stack.name)]
            ratio = "" if stack.name == base else f"**{m.total / reference:.2f}×**"
            rounds = results[(scenario.name, stack.name)]
            paired = "" if stack.name == base else paired_ratio(rounds, results[(scenario.name, base)])
            lines.append(f"| {scenario.name} | {stack.name} | {m.cpu_ms['api']:.2f} | {m.cpu_ms['worker']:.2f} | "
                         f"{m.cpu_ms['redis']:.2f} | {m.total:.2f} | {m.rps:.1f} | {ratio} | {paired} | "
                         f"{m.engine_calls:.1f} | {m.redis_commands:.1f} | {m.redis_round_trips:.1f} | "
                         f"{spread(rounds)} |")
    lines += ["", "| scenario | stack | Redis commands per request, by name (medians) |", "|---|---|---|"]
    for scenario in found:
        for stack in stacks:
            named = commands_by_name(medians[(scenario.name, stack.name)])
            lines.append(f"| {scenario.name} | {stack.name} | {named} |")
    lines += ["", "| slope | stack | CPU-ms |", "|---|---|---|"]
    for stack in stacks:
        by_questions = [(s.questions, medians[(s.name, stack.name)].total) for s in found
                        if s.name.endswith("questions, c=16")]
        by_state = [(s.state_tokens / 1000, medians[(s.name, stack.name)].total) for s in found if s.state_tokens]
        if len(by_questions) >= 2:  # a slope needs two points (--only may leave fewer)
            lines.append(f"| per question | {stack.name} | {slope(by_questions):.2f} |")
        if len(by_state) >= 2:
            lines.append(f"| per 1k state tokens | {stack.name} | {slope(by_state):.2f} |")
    lines += ["", "| at rest | stack | API | worker | Redis | total CPU-ms per second |", "|---|---|---|---|---|---|"]
    for stack in stacks:
        rest = {name: statistics.median(r[name] for r in idle[stack.name]) for name in MEASURED}
        lines.append(f"| idle | {stack.name} | {rest['api']:.2f} | {rest['worker']:.2f} | {rest['redis']:.2f} | "
                     f"{sum(rest.values()):.2f} |")
    lines.append("")
    lines.append(f"ratios: {new} / {base}, medians of the rounds")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of today's path")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per scenario and stack")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (a smoke run)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="times the default number of requests per run: CPU is read in 10 ms ticks per process, "
                             "so a run of a few hundred ms (24 README requests at c=1) moves by a tick's share "
                             "(~20%%); --scale 8 brings that under 3%%")
    parser.add_argument("--idle-only", action="store_true", help="only the stacks at rest (no requests)")
    parser.add_argument("--idle-floor", action="store_true",
                        help="only this checkout at rest, with liveness trimmed (poll, probe, Redis hz), beside a "
                             "bare uvicorn, the API's own server and a bare 10 Hz asyncio loop")
    parser.add_argument("--awake-cores", action="store_true",
                        help="with --idle-floor: measure beside one nice-19 busy loop per core (bench/awake.py)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only the scenarios whose name contains TEXT (repeatable)")
    parser.add_argument("--unbatched", action="store_true",
                        help="also run this checkout with OPENJEV_BRANCH_BATCH_SIZE=1 (one call per branch)")
    args = parser.parse_args()

    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-cpu-cost-"))
    if args.idle_floor:
        print("\n".join(idle_floor(model_dir, log_dir, args.rounds, args.idle_seconds, args.awake_cores)), flush=True)
        return 0
    found = [] if args.idle_only else scenarios(model_dir, 0.25 if args.quick else args.scale)
    if args.only:
        found = [s for s in found if any(text in s.name for text in args.only)]
    with ExitStack() as resources:
        base_root = resources.enter_context(baseline_checkout(args.baseline))
        wanted = [Stack(f"baseline {args.baseline}", base_root, str(base_root / ".venv" / "bin" / "python"))]
        if args.unbatched:
            wanted.append(Stack("this, batch size 1", ROOT, sys.executable, {"OPENJEV_BRANCH_BATCH_SIZE": "1"}))
        wanted.append(Stack("this checkout", ROOT, sys.executable))
        stacks = [resources.enter_context(running_stack(stack, model_dir, log_dir)) for stack in wanted]
        for stack in stacks:  # connections, tokenizer caches, the engine's first calls
            for scenario in found:
                uvloop.run(load(stack.url, scenario.body, 4, 8, scenario.path))
        results: dict[tuple[str, str], list[Sample]] = {}
        idle: dict[str, list[dict[str, float]]] = {s.name: [] for s in stacks}
        for round_index in range(args.rounds):
            order = stacks if round_index % 2 == 0 else stacks[::-1]
            for scenario in found:
                for stack in order:
                    sample = measure(stack, scenario)
                    results.setdefault((scenario.name, stack.name), []).append(sample)
                    parts = " ".join(f"{name} {sample.cpu_ms[name]:.2f}" for name in MEASURED)
                    print(f"round {round_index + 1} {scenario.name:28} {stack.name:18} {sample.total:7.2f} CPU-ms "
                          f"({parts}) {sample.rps:7.1f} req/s", file=sys.stderr, flush=True)
            for stack in order:
                idle[stack.name].append(idle_ms_per_second(stack, args.idle_seconds))
            # The report so far after every round: a run cut short still leaves its medians.
            print(f"after round {round_index + 1} of {args.rounds}; scripted engine (not measured); load average "
                  f"{os.getloadavg()[0]:.1f}; logs in {log_dir}")
            for stack in stacks:
                print(f"{stack.name}: {retried_503.get(stack.url, 0)} requests answered 503 and sent again, "
                      f"{failed.get(stack.url, 0)} without a 200")
            print("\n".join(report(stacks, results, found, idle)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
