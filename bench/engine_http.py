"""CPU per engine call: the worker's transport (worker/engine_http.py, a protocol of its own over
httptools) against httpcore's connection pool (the worker's transport until 2026-12-06) and an
httpx.AsyncClient doing the same calls, in one process on the worker's event loop (uvloop), rounds
interleaved, against the scripted engine (a separate process, not measured). Calls: a README-sized
`/generate` body (POST, ~1.5 KB), a batch of 64 such prompts in one call, and the health probe (GET), back
to back and 2 s apart (as the worker probes). Each figure is CPU-ms per call; the ratios are against httpx.

    uv run --extra cpu --extra dev python -m bench.engine_http [--calls 200] [--rounds 5] [--loop asyncio]

Figures: bench/RESULTS-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpcore
import httpx
import orjson
import uvloop

from harness.web import web
from openjev.embedded_redis import free_port
from worker.engine_http import EngineHttp

BODY = orjson.dumps({"input_ids": list(range(300)), "rid": "bench",
                     "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
                     "logprob_start_len": -1, "token_ids_logprob": [32, 33, 34], "top_logprobs_num": 0,
                     "return_text_in_logprobs": False})
BATCH = orjson.dumps({"input_ids": [list(range(300))] * 64, "rid": [f"bench-{i}" for i in range(64)],
                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
                      "logprob_start_len": -1, "token_ids_logprob": [32, 33], "top_logprobs_num": 0,
                      "return_text_in_logprobs": False})


async def cpu_ms_per_call(call: Callable[[], Awaitable[object]], calls: int, gap: float = 0.0) -> float:
    started = time.process_time()
    for _ in range(calls):
        await call()
        if gap:
            await asyncio.sleep(gap)
    return (time.process_time() - started) * 1000 / calls


def clients(base: str) -> tuple[dict[str, Callable[[bytes], Callable[[], Awaitable[None]]]],
                                 dict[str, Callable[[], Awaitable[None]]], Callable[[], Awaitable[None]]]:
    """For each client: a POST of a body and a GET /health, as callables; and how to close them all."""
    client = httpx.AsyncClient(base_url=base, timeout=30)
    pool = httpcore.AsyncConnectionPool(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0)
    engine = EngineHttp(base, max_connections=1, keepalive_expiry=4.0)
    json_header = [(b"Content-Type", b"application/json")]
    timeouts = {"timeout": {"connect": 5.0, "read": 30.0, "write": 30.0, "pool": 30.0}}

    def httpx_post(body: bytes) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            response = await client.post("/generate", content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 200, response.text
        return call

    def httpcore_post(body: bytes) -> Callable[[], Awaitable[None]]:
        async def call() -> None:  # as worker/engine_http.py did before: stream, then read the body
            async with pool.stream("POST", base + "/generate", headers=json_header, content=body,
                                   extensions=timeouts) as response:
                await response.aread()
            assert response.status == 200
        return call

    def ours_post(body: bytes) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            assert (await engine.request("POST", "/generate", 30.0, body)).status == 200
        return call

    async def httpx_health() -> None:
        assert (await client.get("/health")).status_code == 200

    async def httpcore_health() -> None:
        async with pool.stream("GET", base + "/health", extensions=timeouts) as response:
            await response.aread()
        assert response.status == 200

    async def ours_health() -> None:
        assert (await engine.request("GET", "/health", 30.0)).status == 200

    async def close() -> None:
        await client.aclose()
        await pool.aclose()
        await engine.aclose()

    return ({"httpx": httpx_post, "httpcore": httpcore_post, "ours": ours_post},
            {"httpx": httpx_health, "httpcore": httpcore_health, "ours": ours_health}, close)


async def run(base: str, calls: int, rounds: int) -> None:
    posts, healths, close = clients(base)
    try:
        cases = [("POST /generate", {k: post(BODY) for k, post in posts.items()}, calls, 0.0),
                 ("POST /generate, 64 prompts", {k: post(BATCH) for k, post in posts.items()}, max(1, calls // 8), 0.0),
                 ("GET /health", healths, calls, 0.0),
                 ("GET /health, 2 s apart", healths, 5, 2.0)]
        print("| call | httpx.AsyncClient CPU-ms | httpcore pool CPU-ms | worker/engine_http.py CPU-ms | "
              "httpcore / httpx | ours / httpx |\n|---|---|---|---|---|---|")
        for name, calls_of, n, gap in cases:
            for call in calls_of.values():
                await call()  # connections up
            samples: dict[str, list[float]] = {label: [] for label in calls_of}
            for r in range(rounds if not gap else 2):
                order = list(calls_of.items())
                for label, call in order if r % 2 == 0 else order[::-1]:
                    samples[label].append(await cpu_ms_per_call(call, n, gap))
            a, b, c = (statistics.median(samples[k]) for k in ("httpx", "httpcore", "ours"))
            print(f"| {name} | {a:.3f} | {b:.3f} | {c:.3f} | {b / a:.2f}× | **{c / a:.2f}×** |", flush=True)
    finally:
        await close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per round and client")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the event loop (the worker's is uvloop)")
    args = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "harness.scripted_engine", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                web.get(base + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        (uvloop.run if args.loop == "uvloop" else asyncio.run)(run(base, args.calls, args.rounds))
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
