"""What an API process killed with sync requests queued costs the others (common/queue/presence.py). Real
processes: a Redis, a scripted engine (each call stalls `--call-seconds`), one worker running one job at a
time, and two API replicas. Replica A sends `--a-requests` sync requests at once; a second later replica B
sends `--b-requests` (queued behind A's); a second after that A is killed with SIGKILL. Reported: how many
of A's jobs the engine ran (its clients are gone), when B's answers came, when the queue drained, and the
worker's endings ("gone": a job of A not run).

    uv run --extra cpu --extra dev python -m bench.api_crash [--a-requests 30] [--b-requests 10] [--call-seconds 0.5]

To run it against another commit, run this file with PYTHONPATH at a worktree of that commit (its harness
and its openjev). Figures: bench/RESULTS-chaos.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import redis

from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.redis_servers import fresh_redis
from harness.stacks import model_cache_dir, stack_env
from harness.web import web

KILL_AFTER = 1.0  # seconds between B's requests and A's kill


def body(state: str) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state,
            "questions": {"q": {"type": "noul", "instructions": "Is this a greeting?"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-requests", type=int, default=30, help="sync requests sent to the replica killed")
    parser.add_argument("--b-requests", type=int, default=10, help="sync requests sent to the other replica")
    parser.add_argument("--call-seconds", type=float, default=0.5, help="seconds each engine call stalls")
    args = parser.parse_args()
    model_dir = Path(os.environ.get("OPENJEV_TOKENIZER", model_cache_dir() / "SmolLM2-135M-Instruct.Q4_1"))
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-api-crash-"))
    with fresh_redis() as url:
        env = stack_env(url, model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS="1")
        engine = start_scripted_engine(log_dir)
        assert engine.url
        worker = start_worker(log_dir, env, engine.url, "w0")
        doomed, survivor = start_api(log_dir, env), start_api(log_dir, env)
        procs: list[Proc] = [engine, worker, doomed, survivor]
        try:
            web.post(f"{engine.url}/script", json={"delay": args.call_seconds}, timeout=5).raise_for_status()
            began = time.monotonic()

            def post(api: Proc, state: str) -> tuple[int | str, float]:
                try:
                    response = web.post(f"{api.url}/v1/systemone", json=body(state), timeout=300)
                    return response.status_code, time.monotonic() - began
                except Exception as exc:  # A's clients lose their connection: that is what is counted
                    return type(exc).__name__, time.monotonic() - began

            with ThreadPoolExecutor(args.a_requests + args.b_requests) as pool:
                a: list[Future[tuple[int | str, float]]] = [pool.submit(post, doomed, f"A {i}")
                                                            for i in range(args.a_requests)]
                time.sleep(KILL_AFTER)  # the bench's schedule, not a wait for readiness
                b = [pool.submit(post, survivor, f"B {i}") for i in range(args.b_requests)]
                time.sleep(KILL_AFTER)
                doomed.stop(signal.SIGKILL)
                a_results, b_results = [f.result() for f in a], [f.result() for f in b]
            with redis.Redis.from_url(url) as client:
                while client.zcard("openjev:queue:w0"):
                    time.sleep(0.1)
                drained, asked = time.monotonic() - began, time.time()
                while (beat := orjson.loads(client.get("openjev:worker:w0") or b"{}")).get("heartbeat_at", 0) < asked:
                    time.sleep(0.1)  # until a heartbeat made since the queue drained: it carries the last endings
                counters = beat.get("counters", {})
            stats = web.get(f"{engine.url}/stats", timeout=5).json()
        finally:
            for proc in procs:
                proc.stop()
    warm_calls = sum(1 for rid in stats["received"] if rid.endswith(".warm"))
    b_answered = [t for code, t in b_results if code == 200]
    print(f"A: {sum(1 for code, _ in a_results if code == 200)} of {args.a_requests} answered before the kill; "
          f"A's jobs the engine ran: {warm_calls - len(b_answered)}")
    print(f"B: {len(b_answered)} of {args.b_requests} answered 200, the first at {min(b_answered, default=0):.1f} s, "
          f"the last at {max(b_answered, default=0):.1f} s")
    print(f"queue drained at {drained:.1f} s; engine prompts {stats['requests_received']}; "
          f"worker endings {counters.get('endings')}; logs in {log_dir}")


if __name__ == "__main__":
    main()
