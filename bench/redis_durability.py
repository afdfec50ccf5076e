"""What durability costs a request: the same sync requests through one stack (the project's own
Redis, a worker, the API, the scripted engine), with Redis's append-only file off (`CONFIG SET
appendonly no`, the old setting), on as every layout runs it (`appendfsync everysec`: written before
the reply, fsynced once a second in the background) and on with `appendfsync always` (fsynced before
the reply), switched between interleaved rounds on the same running processes.

    uv run --extra cpu --extra dev python -m bench.redis_durability [--requests 400]

Prints p50/p99 per setting and the difference to AOF off at concurrency 1 and 16, and the CPU-ms per
request of the Redis process. Figures: bench/RESULTS-durability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from bench.queue_latency import percentile
from common.contract import EXAMPLE_REQUEST
from harness.processes import start_api, start_scripted_engine, start_worker
from harness.procfs import cpu_seconds
from harness.stacks import model_cache_dir, stack_env
from openjev.embedded_redis import RedisServer

ROUNDS = 4  # per setting and concurrency, alternating, so drift in machine load hits both alike


SETTINGS = ("off", "everysec", "always")  # the append-only file off, or on with this fsync policy


def set_persistence(client: redis.Redis, setting: str) -> None:
    """Switch the append-only file; turning it on rewrites it in the background: wait for that."""
    if setting != "off":
        client.config_set("appendfsync", setting)
    client.config_set("appendonly", "no" if setting == "off" else "yes")
    while client.info("persistence")["aof_rewrite_in_progress"] or client.info("persistence")[
            "aof_rewrite_scheduled"]:
        time.sleep(0.05)


async def measure(url: str, concurrency: int, requests: int) -> list[float]:
    """Latencies (ms) of `requests` sync requests, `concurrency` at a time."""
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one() -> None:
            async with gate:
                started = time.perf_counter()
                response = await client.post("/v1/systemone", json=EXAMPLE_REQUEST)
                latencies.append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, response.text

        await asyncio.gather(*(one() for _ in range(requests)))
    return latencies


def bench(url: str, client: redis.Redis, redis_pid: int, requests: int) -> list[str]:
    asyncio.run(measure(url, 1, 10))  # warm connections and the engine's prefix cache
    lines = ["| concurrency | persistence | p50 ms | p99 ms | Redis CPU-ms per request |", "|---|---|---|---|---|"]
    for concurrency in (1, 16):
        samples: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        cpu: dict[str, float] = dict.fromkeys(SETTINGS, 0.0)
        for _ in range(ROUNDS):
            for setting in SETTINGS:
                set_persistence(client, setting)
                before = cpu_seconds(redis_pid)
                samples[setting] += asyncio.run(measure(url, concurrency, requests // ROUNDS))
                cpu[setting] += cpu_seconds(redis_pid) - before
        for setting in SETTINGS:
            per_request = cpu[setting] * 1000 / len(samples[setting])
            lines.append(f"| {concurrency} | {setting} | {percentile(samples[setting], 0.5):.2f} | "
                         f"{percentile(samples[setting], 0.99):.2f} | {per_request:.3f} |")
        for setting in SETTINGS[1:]:
            p50 = percentile(samples[setting], 0.5) - percentile(samples["off"], 0.5)
            p99 = percentile(samples[setting], 0.99) - percentile(samples["off"], 0.99)
            lines.append(f"| {concurrency} | **{setting} adds** | {p50:+.2f} | {p99:+.2f} | |")
    set_persistence(client, "everysec")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="per setting and concurrency")
    args = parser.parse_args()

    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    log_dir = Path(tempfile.mkdtemp(prefix="openjev-bench-"))
    server = RedisServer.on(log_dir / "redis")
    redis_process = server.start()
    server.wait_ready()
    engine = start_scripted_engine(log_dir)
    env = stack_env(server.url, model_dir)
    worker = start_worker(log_dir, env, engine.url or "", "bench-0")
    api = start_api(log_dir, env)
    client = redis.Redis.from_url(server.url)
    try:
        lines = bench(api.url or "", client, redis_process.pid, args.requests)
    finally:
        client.close()
        for proc in (api, worker, engine):
            proc.stop()
        server.stop()
    print(f"{args.requests} sync requests per setting and concurrency (the README example, 3 questions), "
          "scripted engine")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
