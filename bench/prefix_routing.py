"""Prefix-cache hits by routing policy, in one run: the same workload of distinct states, each asked
several times in a random order (fixed seed), served by
  1. one worker whose engine keeps everything cached (the ideal: every repeat finds its state),
  2. N workers with prefix-hash routing (rendezvous + bounded load, OPENJEV_ROUTING=hash),
  3. N workers with round-robin routing (OPENJEV_ROUTING=round_robin; a baseline, never production).
Each phase sends its own copies of the states (tagged per phase), so no phase finds another's
prefixes cached. Jobs go through the API's own code (JobPreparer + JobQueue, in this process) to
real worker processes, each beside its own engine.

    uv run --extra cpu --extra dev python -m bench.prefix_routing [--engine cpu|scripted] [--workers 4]
        [--states 48] [--asks 4] [--turns 6] [--options 3] [--concurrency 1] [--worker-slots 16] [--seed 7]

Figures come from the workers' published counters (cached / prompt tokens over branch calls and
over warm calls, jobs per worker), cross-checked against the engines' own /stats totals.
Figures: bench/RESULTS-routing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from arq.connections import ArqRedis

from api.preparation import JobPreparer
from api.queue_client import CompletionWaiter, JobQueue
from common.contract import SystemOneRequest
from common.prompt import PromptCompiler
from common.queue.membership import RESTING_HEARTBEAT_INTERVAL, WorkerCounters, live_workers
from common.queue.records import JobStore
from common.redis_connection import redis_connection
from common.routing import prefix_key, rank_workers
from common.settings import RoutingPolicy, Settings
from common.tokenizer import load_tokenizer
from harness.processes import Proc, start_cpu_engine, start_scripted_engine, start_worker
from harness.stacks import model_cache_dir, stack_env
from harness.web import web
from openjev.embedded_redis import start_redis

TEAMS = {"Billing": "Payments, invoices, refunds", "Technical": "Bugs, outages, integrations",
         "Sales": "Pricing, upgrades"}
AREAS = ["invoices", "refunds", "card payments", "outages", "single sign-on", "exports", "the public API",
         "mobile apps", "pricing", "upgrades", "contracts", "data retention", "security reviews", "onboarding"]


def questions(options: int) -> dict[str, dict]:
    """The three questions every job asks; `options` > 3 gives the routing question that many
    teams, each with a one-line remit (a long question suffix)."""
    teams = TEAMS if options <= 3 else {
        f"Team {i + 1}": f"Handles {AREAS[i % len(AREAS)]} and {AREAS[(i * 5 + 3) % len(AREAS)]} for "
                         f"{['Team', 'Pro', 'Enterprise'][i % 3]} plan customers in region {i // 3 + 1}"
        for i in range(options)}
    return {
        "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
        "team": {"type": "choice", "instructions": "Which team should handle this ticket?", "criteria": teams},
        "urgency": {"type": "score", "instructions": "How urgent is this ticket?",
                    "criteria": ["Low", "Medium", "High"]},
    }
PRODUCTS = ["the invoicing module", "the mobile app", "single sign-on", "the CSV export", "the public API",
            "the billing portal", "two-factor login", "the reporting dashboard"]
PROBLEMS = ["charged me twice", "stopped loading after the update", "shows the wrong totals",
            "logs me out every few minutes", "rejects our company card", "times out on large files"]
ASKS = ["Please refund the duplicate.", "Can someone call me back today?", "Is there a workaround?",
        "We may cancel if this goes on.", "Please escalate this."]
HISTORY = ["Agent: Thanks for reaching out, could you tell me your account number?",
           "Customer: It is on the ticket, I already sent it twice.",
           "Agent: I can see two charges on the same day for the same amount.",
           "Customer: Yes, and my bank says both went through.",
           "Agent: I have forwarded this to the billing team with your screenshots.",
           "Customer: That was three days ago and nobody came back to me.",
           "Agent: I restarted the sync job on our side, could you try again now?",
           "Customer: Same error, the page stays blank after the spinner.",
           "Agent: Which browser and version are you using?",
           "Customer: Chrome on a Mac, the latest one, and Safari does the same.",
           "Agent: Our engineers are aware of an issue affecting some accounts.",
           "Customer: We have a board meeting on Friday and need the numbers by then.",
           "Agent: I have raised the priority of your case and added a note for the next shift.",
           "Customer: Please make sure someone actually reads it this time."]


@dataclass(frozen=True)
class Phase:
    name: str
    routing: RoutingPolicy
    workers: int  # the first this many workers serve the phase


@dataclass
class PhaseResult:
    phase: Phase
    counters: WorkerCounters  # summed over the phase's workers, this phase only
    jobs: dict[str, int]  # jobs answered per worker
    engine_prompt_tokens: int  # the engines' own totals, for a cross-check
    engine_cached_tokens: int
    seconds: float


def workload(states: int, asks: int, seed: int, turns: int) -> list[str]:
    """`states` distinct support conversations (`turns` past messages each), each asked `asks` times,
    in a random order: the same for every phase."""
    rng = random.Random(seed)
    tickets = [f"Ticket {i}: since Monday {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)} for account "
               f"{rng.randrange(10_000, 99_999)} on the {rng.choice(['Team', 'Pro', 'Enterprise'])} plan. "
               f"{rng.choice(ASKS)}\n" + "\n".join(rng.choices(HISTORY, k=turns)) for i in range(states)]
    order = [t for t in tickets for _ in range(asks)]
    rng.shuffle(order)
    return order


def total_counters(workers: dict[str, WorkerCounters]) -> WorkerCounters:
    fields = WorkerCounters.model_fields
    return WorkerCounters(**{f: sum(getattr(c, f) for c in workers.values()) for f in fields})


def counters_delta(before: dict[str, WorkerCounters], after: dict[str, WorkerCounters]) -> dict[str, WorkerCounters]:
    return {w: WorkerCounters(**{f: getattr(c, f) - getattr(before.get(w, WorkerCounters()), f)
                                 for f in WorkerCounters.model_fields}) for w, c in after.items()}


async def published_counters(redis: ArqRedis) -> dict[str, WorkerCounters]:
    """Every live worker's counters, once a heartbeat has carried the latest figures (a worker with no job
    running beats every RESTING_HEARTBEAT_INTERVAL)."""
    await asyncio.sleep(RESTING_HEARTBEAT_INTERVAL * 1.5)
    return {w.id: w.counters for w in await live_workers(redis)}


def engine_totals(engines: list[Proc]) -> tuple[int, int]:
    stats = [web.get(f"{e.url}/stats", timeout=10).json() for e in engines]
    return sum(s["prompt_tokens"] for s in stats), sum(s["cached_tokens"] for s in stats)


async def run_phase(redis: ArqRedis, store: JobStore, waiter: CompletionWaiter, preparer: JobPreparer, phase: Phase,
                    order: list[str], args: argparse.Namespace, engines: list[Proc]) -> PhaseResult:
    queue = JobQueue(redis, store, waiter, routing=phase.routing)
    gate = asyncio.Semaphore(args.concurrency)
    asked = questions(args.options)

    async def one(state: str) -> None:
        request = SystemOneRequest.model_validate({"model": "jev-latest", "state": f"[{phase.name}] {state}",
                                                   "questions": asked})
        async with gate:
            job = preparer.prepare(request, "req_bench", 600)
            outcome = await queue.run(job, 600)
            assert outcome is not None and outcome.result is not None, outcome

    before, engines_before = await published_counters(redis), engine_totals(engines)
    started = time.perf_counter()
    await asyncio.gather(*(one(state) for state in order))
    seconds = time.perf_counter() - started
    delta = counters_delta(before, await published_counters(redis))
    engines_after = engine_totals(engines)
    return PhaseResult(phase, total_counters(delta), {w: c.jobs_done for w, c in sorted(delta.items())},
                       engines_after[0] - engines_before[0], engines_after[1] - engines_before[1], seconds)


async def wait_for_workers(redis: ArqRedis, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(await live_workers(redis)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} workers live after {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def bench(args: argparse.Namespace, redis_url: str, engines: list[Proc], env: dict[str, str],
                preparer: JobPreparer, log_dir: Path, workers: list[Proc]) -> list[PhaseResult]:
    redis = redis_connection(Settings(_env_file=None, redis_url=redis_url))  # type: ignore[call-arg]
    waiter = CompletionWaiter(redis)
    await waiter.start()
    store = JobStore(redis, 3600)
    order = workload(args.states, args.asks, args.seed, args.turns)
    phases = [Phase("single", RoutingPolicy.hash, 1), Phase("hash", RoutingPolicy.hash, args.workers),
              Phase("round_robin", RoutingPolicy.round_robin, args.workers)]
    results = []
    try:
        for phase in phases:
            while len(workers) < phase.workers:
                workers.append(start_worker(log_dir, env, engines[len(workers)].url or "", f"local-{len(workers)}"))
            await wait_for_workers(redis, phase.workers)
            results.append(await run_phase(redis, store, waiter, preparer, phase, order, args, engines))
            print(f"{phase.name}: {results[-1].seconds:.1f} s", file=sys.stderr, flush=True)
    finally:
        await waiter.stop()
        await redis.aclose()
    return results


def report(results: list[PhaseResult], args: argparse.Namespace) -> list[str]:
    """Two markdown tables: hit ratios against the ideal and round robin; cost and balance."""
    ideal, rr = results[0].counters, results[-1].counters
    lines = [f"engine: {args.engine}; {args.workers} workers; {args.states} states ({args.turns} past messages "
             f"each) × {args.asks} asks = {args.states * args.asks} jobs per phase, 3 questions each "
             f"({max(3, args.options)} options to route among); concurrency {args.concurrency}; "
             f"{args.worker_slots} slots per worker; seed {args.seed}", "",
             "| routing | branch hit ratio | ÷ ideal | ÷ round robin | warm hit ratio | ÷ ideal | ÷ round robin "
             "| all calls |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.counters
        lines.append(f"| {r.phase.name} | {_ratios(c.branch_hit_ratio, ideal.branch_hit_ratio, rr.branch_hit_ratio)} "
                     f"| {_ratios(c.warm_hit_ratio, ideal.warm_hit_ratio, rr.warm_hit_ratio)} "
                     f"| {_tokens(r)[1] / _tokens(r)[0]:.3f} |")
    lines += ["", "| routing | tokens prefilled per job | jobs per worker | max/mean | worker counters = engine "
              "/stats | seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        prompt, cached = _tokens(r)
        jobs = list(r.jobs.values())
        agree = (prompt, cached) == (r.engine_prompt_tokens, r.engine_cached_tokens)
        lines.append(f"| {r.phase.name} | {(prompt - cached) / r.counters.jobs_done:.1f} | {'/'.join(map(str, jobs))} "
                     f"| {max(jobs) * len(jobs) / sum(jobs):.2f} | {'yes' if agree else 'NO'} | {r.seconds:.0f} |")
    return lines


def _ratios(value: float | None, ideal: float | None, round_robin: float | None) -> str:
    if not (value and ideal and round_robin):
        return "n/a | n/a | n/a"
    return f"{value:.3f} | {value / ideal:.2f} | {value / round_robin:.2f}"


def _tokens(r: PhaseResult) -> tuple[int, int]:
    """Prompt and cached tokens over all calls (warm + branches)."""
    c = r.counters
    return c.warm_prompt_tokens + c.branch_prompt_tokens, c.warm_cached_tokens + c.branch_cached_tokens


def key_spread(workers: int, key_counts: tuple[int, ...] = (48, 192, 480), trials: int = 400,
               seed: int = 1) -> list[str]:
    """How evenly rendezvous ranking alone spreads `k` distinct prefixes over the workers (each
    prefix asked equally often: a uniform workload), over `trials` random key sets: the spread a
    fleet with a free slot everywhere shows, since the load bound only moves jobs that would wait."""
    rng = random.Random(seed)
    ids = [f"local-{i}" for i in range(workers)]
    lines = ["| distinct states | median max/mean | 90th percentile | key sets with max/mean ≤ 1.25 |",
             "|---|---|---|---|"]
    for count in key_counts:
        spreads = []
        for _ in range(trials):
            firsts = [rank_workers(prefix_key([rng.randrange(1 << 30) for _ in range(8)]), ids)[0]
                      for _ in range(count)]
            spreads.append(max(firsts.count(w) for w in ids) * workers / count)
        spreads.sort()
        lines.append(f"| {count} | {spreads[trials // 2]:.2f} | {spreads[trials * 9 // 10]:.2f} "
                     f"| {sum(s <= 1.25 for s in spreads) / trials:.0%} |")
    return lines


def start_engines(kind: str, count: int, log_dir: Path, scripted_delay: float) -> list[Proc]:
    """`count` engines started side by side (a CPU engine loads its model in ~20 s)."""
    if kind == "scripted":
        engines = [start_scripted_engine(log_dir) for _ in range(count)]
        for engine in engines:  # every call takes this long, so queues form under concurrency
            web.post(f"{engine.url}/script", json={"delay": scripted_delay}, timeout=5).raise_for_status()
        return engines
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: start_cpu_engine(log_dir, model_cache_dir()), range(count)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["cpu", "scripted"], default="cpu",
                        help="scripted: engines that model a prefix cache by longest common prefix (fast)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--states", type=int, default=48, help="distinct states")
    parser.add_argument("--asks", type=int, default=4, help="times each state is asked")
    parser.add_argument("--turns", type=int, default=6, help="past messages in each state")
    parser.add_argument("--options", type=int, default=3, help="options of the routing question (a long suffix)")
    parser.add_argument("--concurrency", type=int, default=1, help="jobs in flight at once")
    parser.add_argument("--worker-slots", type=int, default=16,
                        help="jobs a worker runs at once; the load bound counts only jobs waiting beyond these")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--scripted-delay", type=float, default=0.05,
                        help="seconds each scripted-engine call takes (--engine scripted)")
    args = parser.parse_args()

    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-bench-"))
    redis_process, redis_url = start_redis()
    engines = start_engines(args.engine, args.workers, log_dir, args.scripted_delay)
    env = stack_env(redis_url, model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS=str(args.worker_slots))
    workers: list[Proc] = []
    try:
        preparer = JobPreparer(Settings(), PromptCompiler.for_tokenizer(load_tokenizer(str(model_dir))))
        results = asyncio.run(bench(args, redis_url, engines, env, preparer, log_dir, workers))
    finally:
        for proc in [*workers, *engines]:
            proc.stop()
        redis_process.terminate()
    print("\n".join(report(results, args)))
    print(f"\nspread of distinct states over {args.workers} workers by rendezvous ranking alone:")
    print("\n".join(key_spread(args.workers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
