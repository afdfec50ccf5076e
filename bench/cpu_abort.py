"""How soon an abort frees the reference CPU engine in the middle of a long prefill (issue 28): a
~4,000-token prompt is sent cold, aborted once its prefill is under way, and the time from the abort to
the engine stopping that computation (its `computes_stopped` counter) is measured, then the time a
small call takes right after.

    uv run --extra cpu --extra dev python -m bench.cpu_abort [--runs 3 --tokens 4000]

Figures: bench/RESULTS-chaos.md.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from harness.processes import start_cpu_engine
from harness.stacks import model_cache_dir
from harness.web import web
from worker.cpu_engine.model import ensure_converted


def long_prompt(tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(model_cache_dir()))
    text = " ".join(f"Line {i}: the customer wrote again about order {i * 7919 % 10007}." for i in range(tokens // 6))
    return tokenizer.encode(text)[:tokens]


def counter(url: str, name: str) -> int:
    return web.get(f"{url}/stats", timeout=10).json()[name]


def one_run(url: str, ids: list[int], run: int) -> str:
    chunks, stopped = counter(url, "prefill_chunks"), counter(url, "computes_stopped")
    body = {"input_ids": ids, "rid": f"long-{run}", "sampling_params": {"max_new_tokens": 0},
            "extra_key": f"cold-{run}"}
    call = threading.Thread(target=lambda: web.post(f"{url}/generate", json=body, timeout=600))
    call.start()
    while counter(url, "prefill_chunks") == chunks:  # until its prefill is under way
        time.sleep(0.02)
    aborted = time.monotonic()
    web.post(f"{url}/abort_request", json={"rid": f"long-{run}"}, timeout=10)
    while counter(url, "computes_stopped") == stopped:
        time.sleep(0.01)
    freed = time.monotonic() - aborted
    started = time.monotonic()
    web.post(f"{url}/generate", json={"input_ids": ids[:40], "rid": f"small-{run}",
                                      "sampling_params": {"max_new_tokens": 0}}, timeout=600)
    call.join()
    return (f"run {run}: engine free {freed:.3f} s after the abort; a 40-token call then took "
            f"{time.monotonic() - started:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    ids = long_prompt(args.tokens)
    engine = start_cpu_engine(Path(tempfile.mkdtemp(prefix="openjev-abort-")), model_cache_dir())
    try:
        for run in range(args.runs):
            print(one_run(engine.url or "", ids, run), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
