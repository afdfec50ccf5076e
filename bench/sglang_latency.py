"""Per-request latency of real SGLang 0.5.23 on the CPU against the reference CPU engine: the same
README example sent to two `openjev serve` stacks (SmolLM2-135M-Instruct on both), one request at a
time, alternating between them, in the same run. Two series: the example itself repeated (its
prefix cached after the first), and the example with a new state each time (a cold prefix).

    OPENJEV_TEST_SGLANG_PYTHON=.cache/sglang-venv/bin/python \\
        uv run --extra cpu --extra dev python -m bench.sglang_latency [--frontend rust|python] [--requests 20]

Prints cold starts and p50/p90 per engine and series, with the SGLang / CPU engine ratio.
Figures: bench/RESULTS-sglang.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from common.contract import EXAMPLE_REQUEST
from harness.sglang_serve import start_sglang_serve, stop_sglang_serve
from harness.stacks import CPU_MODEL_NAME, model_cache_dir
from harness.web import web
from openjev.embedded_redis import free_port
from worker.cpu_engine.model import ensure_converted


def start_cpu_serve(log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """`openjev serve` with the reference CPU engine; its process, URL and seconds to ready."""
    port = free_port()
    started = time.monotonic()
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "openjev", "serve", "--port", str(port)],
                                   env={**os.environ, "OPENJEV_CACHE_DIR": str(model_cache_dir().parent),
                                        "OPENJEV_SERVED_MODEL_NAME": CPU_MODEL_NAME,
                                        "OPENJEV_REDIS_DIR": str(log.with_suffix(".redis"))},
                                   stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"CPU serve exited:\n{log.read_text()[-3000:]}")
        try:
            if web.get(url + "/health", timeout=2).status_code == 200:
                return process, url, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def timed_post(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    response = client.post(url + "/v1/systemone", json=body, timeout=300)
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:500]}")
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(frontend: str, requests: int) -> None:
    python = os.environ.get("OPENJEV_TEST_SGLANG_PYTHON")
    if not python:
        raise SystemExit("set OPENJEV_TEST_SGLANG_PYTHON to SGLang's interpreter (deploy/install_sglang_cpu.sh)")
    model_dir = ensure_converted(model_cache_dir())
    logs = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    cpu_process, cpu_url, cpu_start = start_cpu_serve(logs / "serve-cpu.log")
    sglang = None
    try:
        sglang = start_sglang_serve(frontend, python, model_dir, logs)
        targets = {"cpu engine": cpu_url, f"sglang {frontend}": sglang.url}
        series = {
            "repeated example": lambda i: EXAMPLE_REQUEST,
            "new state each time": lambda i: {**EXAMPLE_REQUEST, "state": f"Ticket {i}: {EXAMPLE_REQUEST['state']}"},
        }
        print(f"cold start: cpu engine {cpu_start:.1f} s, sglang {frontend} {sglang.cold_start_s:.1f} s; "
              f"load average {os.getloadavg()[0]:.1f}")
        with httpx.Client() as client:
            for name in targets:  # one untimed request each: first-use costs are not latency
                timed_post(client, targets[name], series["new state each time"](-1))
            for label, make in series.items():
                latencies: dict[str, list[float]] = {name: [] for name in targets}
                for i in range(requests):
                    order = list(targets) if i % 2 == 0 else list(reversed(targets))
                    for name in order:
                        latencies[name].append(timed_post(client, targets[name], make(i)))
                report(label, latencies)
    finally:
        if sglang is not None:
            stop_sglang_serve(sglang)
        cpu_process.terminate()
        cpu_process.wait(60)


def report(label: str, latencies: dict[str, list[float]]) -> None:
    medians = {}
    for name, values in latencies.items():
        medians[name] = statistics.median(values)
        print(f"{label:22s} {name:14s} n={len(values):3d} p50 {medians[name]:8.1f} ms  "
              f"p90 {percentile(values, 0.9):8.1f} ms  min {min(values):8.1f} ms")
    cpu, sglang = medians.values()
    print(f"{label:22s} ratio sglang / cpu engine at p50: {sglang / cpu:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", choices=["rust", "python"], default="rust")
    parser.add_argument("--requests", type=int, default=20, help="requests per engine and series")
    args = parser.parse_args()
    run(args.frontend, args.requests)


if __name__ == "__main__":
    main()
