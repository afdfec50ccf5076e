"""Wake-ups (worker/wakeups.py): with the worker's look at its queue and arq's poll of aborts at their
slowest setting (5 s), a queued job still starts at once and a cancelled one still stops at once, because
the scripts that queue and cancel jobs wake the worker; a worker that cannot hear wake-ups still runs
every job, on its look at the queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis

from harness.processes import start_api, start_scripted_engine, start_worker
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, isolated_scripted_stack, stack_env
from harness.web import web
from tests.conftest import wait_until
from tests.test_api_contract import NOUL, body

SLOWEST_POLL = "5"  # OPENJEV_WORKER_POLL_DELAY's upper bound


@pytest.fixture(scope="module")
def slow_poll_stack(model_dir, log_dir) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_WORKER_POLL_DELAY=SLOWEST_POLL) as stack:
        yield stack


def queue_ms(response: httpx.Response) -> float:
    """The `queue` stage of the response's Server-Timing: placement to pick-up, by Redis's clock."""
    stages = dict(part.strip().split(";dur=") for part in response.headers["Server-Timing"].split(","))
    return float(stages["queue"])


def test_a_queued_job_starts_without_waiting_for_the_poll(slow_poll_stack: Stack) -> None:
    slow_poll_stack.script(delay=0.0)
    waits = []
    for i in range(5):
        r = slow_poll_stack.post(body({"q": NOUL}, state=f"Ticket {i}: I was charged twice."))
        assert r.status_code == 200, r.text
        waits.append(queue_ms(r))
    # On the look at the queue alone each wait would be spread over 0–5000 ms (all five under 2 s: 1 % odds).
    assert max(waits) < 2000, waits


def test_jobs_queued_behind_a_full_worker_start_as_slots_free_without_waiting_for_the_poll(
        model_dir, log_dir) -> None:
    """A job announced while every slot is busy waits in the wake-up until one frees, not for the next look."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_WORKER_POLL_DELAY=SLOWEST_POLL,
                                 OPENJEV_MAX_CONCURRENT_REQUESTS="1") as stack:
        stack.script(delay=0.5)  # each job: a warm call and one branch, ~1 s
        done: dict[str, float] = {}

        def ask(name: str) -> None:
            r = stack.post(body({"q": NOUL}, state=f"Ticket {name}: I was charged twice."), timeout=60)
            assert r.status_code == 200, r.text
            done[name] = time.monotonic()

        first = threading.Thread(target=ask, args=("a",))
        first.start()
        deadline = time.monotonic() + 20
        while not any(r.endswith(".warm") for r in stack.engine_stats()["received"]):
            assert time.monotonic() < deadline, "the first job never reached the engine"
            time.sleep(0.05)
        queued = [threading.Thread(target=ask, args=(name,)) for name in ("b", "c")]
        for thread in queued:
            thread.start()
            time.sleep(0.1)  # the callers' arrival pattern, one after another: not a wait for anything
        for thread in (first, *queued):
            thread.join()
        # Each ~1 s after the one before it; on the look at the queue alone each would also wait 0-5 s for it.
        assert done["c"] - done["a"] < 3.0, done


def test_a_cancelled_job_stops_without_waiting_for_the_poll(slow_poll_stack: Stack) -> None:
    slow_poll_stack.script(delay=30.0)  # every engine call stalls (abortably): there is work to stop
    try:
        before = slow_poll_stack.engine_stats()
        job = web.post(slow_poll_stack.url + "/v1/jobs", json=body({"q": NOUL}), timeout=30).json()
        deadline = time.monotonic() + 20
        while slow_poll_stack.engine_stats()["requests_received"] == before["requests_received"]:
            assert time.monotonic() < deadline, "the job never reached the engine"
            time.sleep(0.05)
        cancelled_at = time.monotonic()
        r = web.delete(f"{slow_poll_stack.url}/v1/jobs/{job['id']}", timeout=30)
        assert r.json()["status"] == "cancelled"
        while slow_poll_stack.engine_stats()["aborts_received"] == before["aborts_received"]:
            assert time.monotonic() < cancelled_at + 10, "no abort reached the engine"
            time.sleep(0.05)
        stopped_after = time.monotonic() - cancelled_at
        assert stopped_after < 2.0, stopped_after  # arq's poll alone: anywhere up to 5 s
        # Stopped by the wake-up, not by arq's abort (which logs "aborted" on its own poll). The line is written
        # as the cancelled job unwinds, which may be just after its engine call's abort went out (CI saw that).
        line = f"job {job['id']}: cancelled; stopped here"
        wait_until(lambda: line in slow_poll_stack.workers[0].output(), 5, "the worker's log of the cancellation")
    finally:
        slow_poll_stack.script(delay=0.0)


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


def test_a_worker_that_cannot_hear_wake_ups_runs_every_job_on_its_look_at_the_queue(model_dir, log_dir) -> None:
    with fresh_redis() as url:
        # A Redis user allowed everything but subscribing: every wake-up is missed.
        redis.Redis.from_url(url).execute_command(
            "ACL", "SETUSER", "deaf", "on", ">deaf-password", "~*", "&*", "+@all", "-subscribe", "-psubscribe")
        env = stack_env(url, model_dir)
        engine = start_scripted_engine(log_dir)
        assert engine.url
        worker = start_worker(log_dir, {**env, "OPENJEV_REDIS_URL": with_user(url, "deaf", "deaf-password"),
                                        "OPENJEV_WORKER_POLL_DELAY": "0.2"}, engine.url, "deaf-0")
        stack = Stack(url, engine, start_api(log_dir, env), [worker], env, log_dir)
        try:
            for i in range(3):
                r = stack.post(body({"q": NOUL}, state=f"Ticket {i}"))
                assert r.status_code == 200, r.text
            assert "the look at the queue carries on" in worker.output()  # it did try, and said so
            assert worker.alive()
        finally:
            stack.stop()
