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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.processes import ROOT, start_scripted_engine, start_worker
from harness.redis_servers import start_redis
from harness.stacks import model_cache_dir, stack_env
from openjev.embedded_redis import free_port
from worker.cpu_engine.model import ensure_converted

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Start:
    cpu_s: float
    wall_s: float
    rss_mb: float
    torch: bool


@contextmanager
def worktree(revision: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="openjev-api-start-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)


def start_api(code: Path, env: dict[str, str]) -> Start:
    port = free_port()
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "openjev", "api", "--port", str(port)], cwd=code,
                               env={**os.environ, **env, "PYTHONPATH": str(code)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=2.0) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the API from {code} exited with {process.returncode}")
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        wall = time.perf_counter() - started
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss = int(Path(f"/proc/{process.pid}/statm").read_text().split()[1]) * PAGE / 2**20
        torch = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
        return Start((int(fields[11]) + int(fields[12])) / TICK, wall, rss, torch)
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
    engine = start_scripted_engine(Path(tempfile.mkdtemp(prefix="openjev-api-start-logs-")))
    worker = start_worker(Path(engine.log).parent, env, engine.url or "", "w0")
    starts: dict[str, list[Start]] = {"baseline": [], "this checkout": []}
    try:
        with worktree(args.baseline) as baseline:
            trees = {"baseline": baseline, "this checkout": ROOT}
            for round_ in range(args.rounds):
                for name in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                    starts[name].append(start_api(trees[name], env))
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
