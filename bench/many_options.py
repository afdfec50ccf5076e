"""`openjev smoke`'s many-options question through a running openjev, at several option counts: where the
model puts the one option that fits (Billing, in the middle of the list) against the fillers, and which
options it prefers instead. For a model that fails smoke's `choice_255_options` semantic check, this says
whether the list's length or its order is to blame (`--debias` asks with label-order debiasing), and
what asking in groups does (`--group-sizes 0 26`: each count asked in one branch, then in groups of 26,
in the same run; omitted: the server's OPENJEV_OPTION_GROUP_SIZE).

    uv run python -m bench.many_options --url http://127.0.0.1:8732 [--counts 26 64 128 255] [--debias] \
        [--group-sizes 0 64] [--cold] [--repeat 2]

`--cold` numbers the ticket in each request's state, so no request finds another's tokens in the engine's
prefix cache and the seconds compare like with like.

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
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[None],
                        help="x_option_group_size values to ask each count with (0: one branch)")
    parser.add_argument("--cold", action="store_true", help="a state of its own per request: nothing cached")
    parser.add_argument("--repeat", type=int, default=1, help="ask every row this many times (in turn)")
    args = parser.parse_args()
    target = TARGET_OPTION[0]
    print(f"| options | group size | engine calls | input tokens | seconds | p({target}) | its rank | "
          "the model's top three |")
    print("|---|---|---|---|---|---|---|---|")
    with httpx.Client(base_url=args.url.rstrip("/"), timeout=1800) as client:
        rows = [(c, g) for _ in range(args.repeat) for c in args.counts for g in args.group_sizes]
        for number, (count, group_size) in enumerate(rows):
            question = {"type": "choice", "instructions": TEAM["instructions"], "criteria": many_options(count)}
            state = f"Ticket {number + 1} of run {time.time_ns()}: {REFUND_STATE}" if args.cold else REFUND_STATE
            body = {"model": "jev-latest", "state": state, "questions": {"q": question},
                    "x_debias": args.debias}
            if group_size is not None:
                body["x_option_group_size"] = group_size
            started = time.perf_counter()
            response = client.post("/v1/systemone", json=body)
            response.raise_for_status()
            seconds = time.perf_counter() - started
            result = response.json()
            ranked = sorted(result["answers"]["q"]["probabilities"].items(), key=lambda kv: -kv[1])
            rank = [name for name, _ in ranked].index(target) + 1
            top = ", ".join(f"{name} {p:.3f}" for name, p in ranked[:3])
            usage = result["usage"]
            shown = "server's" if group_size is None else group_size
            print(f"| {count} | {shown} | {usage['output_tokens']} | {usage['input_tokens']} | {seconds:.1f} | "
                  f"{dict(ranked)[target]:.3f} | {rank} of {count} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
