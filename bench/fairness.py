"""Isolation between clients, measured on one real stack (Redis, the scripted engine at a fixed delay per
call, one worker, the API reading a keys file), each figure against a baseline taken in the same run:

1. backlog: sync `POST /v1/systemone` latency at concurrency 4 while N async jobs of another tenant
   drain, against the same requests on the idle stack; and how many of the async jobs succeeded.
2. fair share: two tenants each submit M async jobs at once; how long each tenant's first job waited
   to start after its submission (the job records' Redis times).
3. limits: a tenant over its requests per minute gets 429 (client-side latency on loopback, an upper
   bound on server time), while another tenant's requests go on.

    uv run --extra cpu --extra dev python -m bench.fairness [--backlog 1000 --each 500 --delay 0.2]

Figures: bench/RESULTS-fairness.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from redis.asyncio import Redis

from common.queue import keys
from harness.processes import start_scripted_engine
from harness.redis_servers import fresh_redis
from harness.stacks import build_stack

KEYS = {"interactive": "bench-interactive-key-0001", "batch": "bench-batch-key-000000001",
        "other": "bench-other-key-000000001", "limited": "bench-limited-key-0000001"}
KEYS_FILE = "".join(f'[tenants.{name}]\nkey = "{key}"\n' for name, key in KEYS.items() if name != "limited") + \
    f'[tenants.limited]\nkey = "{KEYS["limited"]}"\nrequests_per_minute = 1\n'
QUESTION = {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}


def body(state: str) -> dict:
    return {"model": "jev-latest", "state": state, "questions": QUESTION}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sync_latencies(client: httpx.AsyncClient, requests: int, concurrency: int,
                         tag: str) -> tuple[list[float], list[float]]:
    """End-to-end seconds of each sync request, and the seconds each waited in the queue (Server-Timing)."""
    gate = asyncio.Semaphore(concurrency)
    seconds: list[float] = []
    queued: list[float] = []

    async def one(n: int) -> None:
        async with gate:
            started = time.perf_counter()
            r = await client.post("/v1/systemone", json=body(f"{tag} ticket {n}"), headers=auth("interactive"))
            assert r.status_code == 200, r.text
            seconds.append(time.perf_counter() - started)
            queued.append(float(r.headers["server-timing"].split("queue;dur=")[1].split(",")[0]) / 1000)

    await asyncio.gather(*(one(n) for n in range(requests)))
    return seconds, queued


async def submit_all(client: httpx.AsyncClient, tenant: str, count: int, tag: str) -> list[str]:
    gate = asyncio.Semaphore(16)

    async def one(n: int) -> str:
        async with gate:
            r = await client.post("/v1/jobs", json=body(f"{tag} {tenant} {n}"), headers=auth(tenant))
            assert r.status_code == 202, r.text
            return r.json()["id"]

    return list(await asyncio.gather(*(one(n) for n in range(count))))


async def statuses(client: httpx.AsyncClient, tenant: str, job_ids: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job_id in job_ids:
        while True:
            got = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=auth(tenant))).json()
            if got["status"] not in ("queued", "running"):
                break
        counts[got["status"]] = counts.get(got["status"], 0) + 1
    return counts


async def first_start_wait(redis: Redis, job_ids: list[str]) -> float:
    """Seconds from the first submission of `job_ids` to the first start among them (Redis's clock)."""
    times = [[float(v) if v else float("inf") for v in await redis.hmget(keys.job_key(j), "created_at", "started_at")]
             for j in job_ids]
    return min(s for _, s in times) - min(c for c, _ in times)


async def run(args: argparse.Namespace, url: str, redis_url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await sync_latencies(client, 8, 4, "warm-up")
        idle, idle_queued = await sync_latencies(client, args.sync, 4, "idle")
        backlog = await submit_all(client, "batch", args.backlog, "backlog")  # all accepted: now it drains
        loaded, loaded_queued = await sync_latencies(client, args.sync, 4, "loaded")
        left = (await client.get("/v1/limits", headers=auth("batch"))).json()["tenant"]["usage"]["jobs"]
        backlog_ended = await statuses(client, "batch", backlog)
        print(f"backlog: {args.backlog} async jobs of another tenant draining ({left} still not ended when the "
              f"last sync answer came); sync c=4, {args.sync} requests")
        for name, seconds, queued in (("idle", idle, idle_queued), ("backlog", loaded, loaded_queued)):
            print(f"  {name:8s} p50 {statistics.median(seconds) * 1000:7.1f} ms   p90 "
                  f"{quantile(seconds, 0.9) * 1000:7.1f} ms   max {max(seconds) * 1000:7.1f} ms   "
                  f"queue p90 {quantile(queued, 0.9) * 1000:7.1f} ms")
        bound = 2 * quantile(idle, 0.9) + 0.1
        print(f"  target p90 <= 2 x idle p90 + 0.1 s = {bound * 1000:.1f} ms: "
              f"{'met' if quantile(loaded, 0.9) <= bound else 'MISSED'}; async outcomes {backlog_ended}")

        a, b = await asyncio.gather(submit_all(client, "batch", args.each, "fair"),
                                    submit_all(client, "other", args.each, "fair"))
        redis = Redis.from_url(redis_url)
        try:
            waits = {"batch": await first_start_wait(redis, a), "other": await first_start_wait(redis, b)}
        finally:
            await redis.aclose()
        ended = {"batch": await statuses(client, "batch", a), "other": await statuses(client, "other", b)}
        print(f"fair share: two tenants submit {args.each} async jobs each at once")
        for tenant, wait in waits.items():
            print(f"  {tenant:8s} first job started {wait:.3f} s after its first submission; outcomes {ended[tenant]}")

        await client.post("/v1/jobs", json=body("spend the one a minute"), headers=auth("limited"))
        refused: list[float] = []
        others: list[float] = []
        for n in range(50):
            started = time.perf_counter()
            r = await client.post("/v1/jobs", json=body(f"over {n}"), headers=auth("limited"))
            refused.append(time.perf_counter() - started)
            assert r.status_code == 429 and "retry-after" in r.headers and "ratelimit-remaining" in r.headers, r
            started = time.perf_counter()
            r = await client.post("/v1/jobs", json=body(f"beside {n}"), headers=auth("other"))
            others.append(time.perf_counter() - started)
            assert r.status_code == 202, r.text
        print("limits: 50 submissions over a 1-a-minute limit, each followed by another tenant's")
        print(f"  429 p50 {statistics.median(refused) * 1000:.2f} ms  p99 {quantile(refused, 0.99) * 1000:.2f} ms "
              f"(client side, loopback); other tenant's 202 p50 {statistics.median(others) * 1000:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, default=1000, help="async jobs draining in the backlog phase")
    parser.add_argument("--each", type=int, default=500, help="async jobs per tenant in the fair-share phase")
    parser.add_argument("--sync", type=int, default=80, help="sync requests per latency phase")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the scripted engine takes per call")
    args = parser.parse_args()
    from harness.stacks import model_cache_dir
    from worker.cpu_engine.model import ensure_converted

    model_dir = ensure_converted(model_cache_dir())
    with tempfile.TemporaryDirectory() as scratch, fresh_redis() as redis_url:
        keys_file = Path(scratch) / "keys.toml"
        keys_file.write_text(KEYS_FILE)
        stack = build_stack(redis_url, start_scripted_engine(Path(scratch)), model_dir, Path(scratch),
                            OPENJEV_API_KEYS_FILE=str(keys_file), OPENJEV_JOB_TIMEOUT="900")
        try:
            stack.script(delay=args.delay)
            asyncio.run(run(args, stack.url, redis_url))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
