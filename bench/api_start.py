"""What an API process costs to start, as `openjev serve` and the tests start it: in an environment with the
`cpu` extra (torch installed for the CPU engine), reading the CPU engine's converted SmolLM2 tokenizer. This
checkout's `openjev api` against a baseline commit's, started alternately on one Redis, one worker and one
scripted engine (the API's /health answers 200 once a worker is live); for each start, the CPU seconds the
process used until /health first answered 200, the wall seconds, its resident memory then, and whether it
mapped torch. Medians of the rounds; ratios are new / baseline.

    uv run --extra cpu --extra dev python -m bench.api_start [--baseline 62ed11b] [--rounds 4]

The baseline's code runs from a temporary `git worktree` on this checkout's interpreter and environment (the
dependencies are the same; what differs is the code). Figures: bench/RESULTS-cpu.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.cpu_cost import git_worktree
from harness.processes import ROOT, Proc, start_scripted_engine, start_worker, wait_http
from harness.procfs import cpu_seconds
from harness.redis_servers import start_redis
from harness.stacks import model_cache_dir, stack_env
from openjev.embedded_redis import free_port
from worker.cpu_engine.model import ensure_converted

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Start:
    cpu_s: float
    wall_s: float
    rss_mb: float
    torch: bool


def start_api(code: Path, env: dict[str, str], log_dir: Path) -> Start:
    """One start of the API from the code in `code`, measured once its /health first answers 200, then stopped."""
    port = free_port()
    log = log_dir / f"api-{time.monotonic_ns()}.log"
    started = time.perf_counter()
    with log.open("wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "openjev", "api", "--port", str(port)], cwd=code,
                                   env={**os.environ, **env, "PYTHONPATH": str(code)},
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_http(Proc("api", process, log), f"http://127.0.0.1:{port}/health", timeout=180)
        wall = time.perf_counter() - started
        rss = int(Path(f"/proc/{process.pid}/statm").read_text().split()[1]) * PAGE / 2**20
        torch = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
        return Start(cpu_seconds(process.pid), wall, rss, torch)
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="62ed11b")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model_dir = ensure_converted(model_cache_dir())
    redis, redis_url = start_redis()
    env = stack_env(redis_url, model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-api-start-logs-"))
    engine = start_scripted_engine(log_dir)
    worker = start_worker(log_dir, env, engine.url or "", "w0")
    starts: dict[str, list[Start]] = {"baseline": [], "this checkout": []}
    try:
        with git_worktree(args.baseline) as baseline:
            trees = {"baseline": baseline, "this checkout": ROOT}
            for round_ in range(args.rounds):
                for name in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                    starts[name].append(start_api(trees[name], env, log_dir))
    finally:
        worker.stop()
        engine.stop()
        redis.terminate()
        redis.wait(10)
    print(f"API start, medians of {args.rounds} alternating rounds (baseline {args.baseline}):\n")
    print("| API | CPU-s to ready | wall s to ready | RSS MB | torch mapped |")
    print("|---|---|---|---|---|")
    medians = {}
    for name, runs in starts.items():
        medians[name] = [statistics.median(getattr(s, f) for s in runs) for f in ("cpu_s", "wall_s", "rss_mb")]
        print(f"| {name} | {medians[name][0]:.2f} ({', '.join(f'{s.cpu_s:.2f}' for s in runs)}) | "
              f"{medians[name][1]:.2f} | {medians[name][2]:.0f} | {sorted({s.torch for s in runs})} |")
    ratios = [new / old for new, old in zip(medians["this checkout"], medians["baseline"], strict=True)]
    print(f"\nratios (this checkout / baseline): CPU {ratios[0]:.2f}, wall {ratios[1]:.2f}, RSS {ratios[2]:.2f}")


if __name__ == "__main__":
    main()
