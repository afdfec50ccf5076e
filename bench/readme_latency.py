"""The README example's latency through a running openjev, for a state the engine has not seen and for one
it has cached: `--new` requests, each with "(Ticket #N) " put in front of the example's state, then
`--cached` requests of the example itself, one after another; p50 of each kind without its first request
(the first new one pays for the kernels' first use, the first cached one for caching the state).

    uv run --extra cpu --extra dev python -m bench.readme_latency --url http://127.0.0.1:8732 [--new 7] [--cached 6]

Figures: bench/RESULTS-quality.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from common.contract import EXAMPLE_REQUEST


def timed(client: httpx.Client, body: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    response = client.post("/v1/systemone", json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the openjev server root")
    parser.add_argument("--new", type=int, default=7, help="requests with a state not seen before (default 7)")
    parser.add_argument("--cached", type=int, default=6, help="requests of the example's own state (default 6)")
    parser.add_argument("--first-ticket", type=int, default=int(time.time()) % 100000,
                        help="N of the first new state's '(Ticket #N) ' (default: from the clock, so unseen)")
    args = parser.parse_args()
    with httpx.Client(base_url=args.url, timeout=300) as client:
        new = []
        for n in range(args.new):
            body = EXAMPLE_REQUEST | {"state": f"(Ticket #{args.first_ticket + n}) {EXAMPLE_REQUEST['state']}"}
            seconds, answer = timed(client, body)
            new.append(seconds)
            print(f"new state {seconds:.2f} s: department {answer['answers']['department']['choice']}")
        cached = []
        for _ in range(args.cached):
            seconds, answer = timed(client, EXAMPLE_REQUEST)
            cached.append(seconds)
            print(f"cached state {seconds:.2f} s")
    print(f"p50 without the first: new state {statistics.median(new[1:] or new):.2f} s, "
          f"cached state {statistics.median(cached[1:] or cached):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
