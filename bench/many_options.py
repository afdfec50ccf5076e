"""`openjev smoke`'s many-options question through a running openjev, at several option counts: where the
model puts the one option that fits (Billing, in the middle of the list) against the fillers, and which
options it prefers instead. For a model that fails smoke's `choice_255_options` semantic check, this says
whether the list's length or its order is to blame (`--debias` asks with label-order debiasing).

    uv run python -m bench.many_options --url http://127.0.0.1:8732 [--counts 26 64 128 255] [--debias]

Figures: bench/RESULTS-quality.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from openjev.smoke import REFUND_STATE, TARGET_OPTION, TEAM, many_options


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the openjev server root")
    parser.add_argument("--counts", type=int, nargs="+", default=[26, 64, 128, 255], help="option counts to ask")
    parser.add_argument("--debias", action="store_true", help="send x_debias: true")
    args = parser.parse_args()
    target = TARGET_OPTION[0]
    print(f"| options | input tokens | seconds | p({target}) | its rank | the model's top three |")
    print("|---|---|---|---|---|---|")
    with httpx.Client(base_url=args.url.rstrip("/"), timeout=1800) as client:
        for count in args.counts:
            question = {"type": "choice", "instructions": TEAM["instructions"], "criteria": many_options(count)}
            body = {"model": "jev-latest", "state": REFUND_STATE, "questions": {"q": question},
                    "x_debias": args.debias}
            started = time.perf_counter()
            response = client.post("/v1/systemone", json=body)
            response.raise_for_status()
            seconds = time.perf_counter() - started
            result = response.json()
            ranked = sorted(result["answers"]["q"]["probabilities"].items(), key=lambda kv: -kv[1])
            rank = [name for name, _ in ranked].index(target) + 1
            top = ", ".join(f"{name} {p:.3f}" for name, p in ranked[:3])
            print(f"| {count} | {result['usage']['input_tokens']} | {seconds:.1f} | "
                  f"{dict(ranked)[target]:.3f} | {rank} of {count} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
