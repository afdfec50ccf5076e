"""The worker's beat (worker/runner.py `_keep_alive`): every second while it evaluates jobs, so the
load the API routes by stays fresh, and every 2 s at rest, where only liveness changes; either way
well inside the 5 s the lease and the routing set allow."""

from __future__ import annotations

import itertools
import threading
import time

import redis

from common.queue import keys
from common.queue.membership import HEARTBEAT_INTERVAL, LIVENESS_WINDOW, RESTING_HEARTBEAT_INTERVAL
from harness.stacks import isolated_scripted_stack
from tests.conftest import wait_until
from tests.test_api_contract import NOUL, body


def beats(client: redis.Redis, worker_id: str, seconds: float) -> list[float]:
    """The heartbeat stamps (Redis's clock) `worker_id` writes into the routing set over `seconds`."""
    seen: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stamp = client.zscore(keys.WORKERS, worker_id)
        if stamp is not None and (not seen or stamp != seen[-1]):
            seen.append(stamp)
        time.sleep(0.05)
    return seen


def test_the_worker_beats_every_second_while_busy_and_every_two_at_rest(model_dir, log_dir) -> None:
    assert HEARTBEAT_INTERVAL < RESTING_HEARTBEAT_INTERVAL <= LIVENESS_WINDOW / 2.5  # one late beat is survived
    with isolated_scripted_stack(model_dir, log_dir) as stack:
        client = redis.Redis.from_url(stack.redis_url)
        try:
            deadline = time.monotonic() + 60
            while client.zscore(keys.WORKERS, "w0") is None:  # the worker's first heartbeat, at the end of its start
                assert time.monotonic() < deadline, "the worker never joined the routing set"
                time.sleep(0.1)
            resting = beats(client, "w0", 9.0)
            # the stamp found at the start, then one per beat: 1 s apart (the busy cadence) would be 10-11
            # stamps; 2 s apart, 5-6 (fewer only if beats run late)
            assert 3 <= len(resting) <= 6, resting
            assert min(b - a for a, b in itertools.pairwise(resting)) > 1.5, resting

            stack.script(delay=4.0)  # one job: a warm call and one branch, ~8 s in the worker
            answered: list[int] = []
            job = threading.Thread(target=lambda: answered.append(stack.post(body({"q": NOUL})).status_code))
            job.start()
            # the first beat that counts the job running: the resting wait pending when it arrived is over
            wait_until(lambda: client.hget(keys.route_info_key("w0"), "running") == b"1", 10,
                       "a heartbeat of w0 with the job running")
            busy = beats(client, "w0", 5.0)
            job.join(60)
            assert answered == [200]
            assert len(busy) >= 5, busy  # the stamp found, then every second (2 s apart: at most 4 in all)
        finally:
            client.close()
