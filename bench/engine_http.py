"""CPU per engine call: the worker's transport (worker/engine_http.py, httpcore's pool) against an
httpx.AsyncClient doing the same calls, in one process, rounds interleaved, against the scripted
engine (a separate process, not measured). Calls: a README-sized `/generate` body (POST, ~1.5 KB), a
batch of 64 such prompts in one call, and the health probe (GET), back to back and 2 s apart (as the worker probes).

    uv run --extra cpu --extra dev python -m bench.engine_http [--calls 200] [--rounds 5]

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

import httpx
import orjson

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


async def run(base: str, calls: int, rounds: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        engine = EngineHttp(base, max_connections=1, keepalive_expiry=4.0)
        try:
            def httpx_post(body: bytes) -> Callable[[], Awaitable[None]]:
                async def call() -> None:
                    response = await client.post("/generate", content=body,
                                                 headers={"Content-Type": "application/json"})
                    assert response.status_code == 200, response.text
                return call

            def ours_post(body: bytes) -> Callable[[], Awaitable[None]]:
                async def call() -> None:
                    status, _ = await engine.request("POST", "/generate", 30.0, body)
                    assert status == 200
                return call

            async def httpx_health() -> None:
                assert (await client.get("/health")).status_code == 200

            async def ours_health() -> None:
                assert (await engine.request("GET", "/health", 30.0))[0] == 200

            cases = [("POST /generate", httpx_post(BODY), ours_post(BODY), calls, 0.0),
                     ("POST /generate, 64 prompts", httpx_post(BATCH), ours_post(BATCH), max(1, calls // 8), 0.0),
                     ("GET /health", httpx_health, ours_health, calls, 0.0),
                     ("GET /health, 2 s apart", httpx_health, ours_health, 5, 2.0)]
            print("| call | httpx.AsyncClient CPU-ms | worker/engine_http.py CPU-ms | ratio |\n|---|---|---|---|")
            for name, theirs, ours, n, gap in cases:
                await theirs(), await ours()  # connections up
                samples: dict[str, list[float]] = {"httpx": [], "ours": []}
                for r in range(rounds if not gap else 2):
                    order = [("httpx", theirs), ("ours", ours)]
                    for label, call in order if r % 2 == 0 else order[::-1]:
                        samples[label].append(await cpu_ms_per_call(call, n, gap))
                a, b = statistics.median(samples["httpx"]), statistics.median(samples["ours"])
                print(f"| {name} | {a:.3f} | {b:.3f} | **{b / a:.2f}×** |", flush=True)
        finally:
            await engine.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per round and client")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "harness.scripted_engine", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        asyncio.run(run(base, args.calls, args.rounds))
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
