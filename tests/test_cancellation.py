"""No GPU time for work nobody waits for: a client that hangs up, a deadline, a DELETE each end
the job and abort its calls, proven from the reference CPU engine's own counters. Also admission
(529 when a job could not finish before its deadline, 503 without workers) and fairness."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.processes import start_cpu_engine
from harness.stacks import Stack, build_stack, isolated_scripted_stack, model_cache_dir
from harness.web import web
from tests.conftest import wait_for_next_heartbeat
from tests.test_api_contract import NOUL, body

THREE = {"a": NOUL, "b": NOUL, "c": NOUL}


@pytest.fixture(scope="module")
def slow_stack(redis_server: str, model_dir, log_dir) -> Iterator[Stack]:
    """The CPU engine stalling 1 s before each request (abortably), so there is work to cancel."""
    engine = start_cpu_engine(log_dir, model_cache_dir(), compute_delay=1.0)
    stack = build_stack(redis_server, engine, model_dir, log_dir, OPENJEV_REQUEST_TIMEOUT="2.5")
    yield stack
    stack.stop()


def settle(stack: Stack, before: dict, expected_received: int, timeout: float = 15.0) -> dict:
    """Engine counters once every request it received since `before` has been answered or aborted."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stack.engine_stats()
        received = stats["requests_received"] - before["requests_received"]
        done = (stats["requests_finished"] - before["requests_finished"]
                + stats["requests_aborted"] - before["requests_aborted"])
        if (received >= expected_received and done >= received) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def test_a_client_that_hangs_up_cancels_the_job_and_its_engine_calls(slow_stack: Stack) -> None:
    before = slow_stack.engine_stats()
    with pytest.raises(httpx.ReadTimeout):
        slow_stack.post(body(THREE), timeout=1.5)  # warm 1 s + 3 branches 1 s each: we leave during the branches
    after = settle(slow_stack, before, expected_received=1)
    assert delta(after, before, "aborts_received") >= 1
    assert delta(after, before, "requests_aborted") >= 1
    assert delta(after, before, "requests_finished") <= 2  # at most the warm call and one branch ran
    assert delta(after, before, "requests_received") <= 4


def test_past_the_deadline_the_caller_gets_504_and_the_work_is_aborted(slow_stack: Stack) -> None:
    before = slow_stack.engine_stats()
    started = time.monotonic()
    r = slow_stack.post(body(THREE), timeout=30)
    assert r.status_code == 504
    assert r.json()["detail"]["error_type"] == "timeout_error"
    assert time.monotonic() - started < 5.0
    after = settle(slow_stack, before, expected_received=1)
    assert delta(after, before, "requests_aborted") >= 1
    assert delta(after, before, "requests_finished") <= 3


def test_a_deleted_async_job_stops_in_the_engine(slow_stack: Stack) -> None:
    before = slow_stack.engine_stats()
    job = web.post(slow_stack.url + "/v1/jobs", json=body(THREE), timeout=30).json()
    deadline = time.monotonic() + 20  # until the warm call finished and branches are in the engine
    while slow_stack.engine_stats()["requests_received"] - before["requests_received"] < 2:
        assert time.monotonic() < deadline, "the job's branches never reached the engine"
        time.sleep(0.05)
    cancelled = web.delete(f"{slow_stack.url}/v1/jobs/{job['id']}", timeout=30).json()
    assert cancelled["status"] == "cancelled"
    after = settle(slow_stack, before, expected_received=2)
    assert delta(after, before, "aborts_received") >= 1
    assert delta(after, before, "requests_aborted") >= 1
    assert delta(after, before, "requests_finished") <= 2


@pytest.fixture(scope="module")
def tight_stack(model_dir, log_dir) -> Iterator[Stack]:
    """Its own Redis (so no other worker takes its jobs): one job at a time, a scripted engine,
    short deadlines; arq's poll at its slowest, so a job queued behind another starts on its wake-up."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_REQUEST_TIMEOUT="5", OPENJEV_MAX_CONCURRENT_REQUESTS="1",
                                 OPENJEV_MAX_CONCURRENT_BRANCHES="2", OPENJEV_JOB_TIMEOUT="2",
                                 OPENJEV_WORKER_POLL_DELAY="5") as stack:
        yield stack


def test_a_job_whose_deadline_passed_in_the_queue_is_expired_not_run(tight_stack: Stack) -> None:
    tight_stack.script(delay=1.5)
    # A sync request (5 s deadline) holds the one-job worker for ~3 s ...
    holder = threading.Thread(target=lambda: tight_stack.post(body({"q0": NOUL}), timeout=30))
    holder.start()
    deadline = time.monotonic() + 20
    while not any(r.endswith(".warm") for r in tight_stack.engine_stats()["received"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # ... so an async job (2 s deadline) is still queued when its deadline passes.
    job = web.post(tight_stack.url + "/v1/jobs", json=body({"q1": NOUL}), timeout=30).json()
    holder.join()
    status = web.get(f"{tight_stack.url}/v1/jobs/{job['id']}", params={"wait": 10}, timeout=20).json()
    received = tight_stack.engine_stats()["received"]
    assert status["status"] == "expired"
    assert status["error"]["error_type"] == "timeout_error"
    assert not [rid for rid in received if rid.startswith(job["id"])]  # the engine never saw it
    tight_stack.script(delay=0.0)


def test_when_no_worker_could_finish_in_time_new_requests_get_529_fast(tight_stack: Stack) -> None:
    tight_stack.script(delay=0.8)
    assert tight_stack.post(body()).status_code == 200  # teaches the worker its job time (~1.6 s)
    wait_for_next_heartbeat(tight_stack.redis_url, "w0")  # it carries that job time to the routing fields
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(tight_stack.post(body(), timeout=30))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.1)  # the callers' arrival pattern, one after another: not a wait for anything
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert 200 in statuses and 529 in statuses, statuses
    assert set(statuses) <= {200, 529}, statuses  # what was admitted could finish in time
    shed = next(r for r in results if r.status_code == 529)
    assert shed.json()["detail"]["error_type"] == "overloaded_error"
    assert int(shed.headers["retry-after"]) >= 1
    assert shed.elapsed.total_seconds() < 1.0
    tight_stack.script(delay=0.0)


@pytest.fixture
def two_slot_stack(model_dir, log_dir) -> Iterator[Stack]:
    """Its own Redis: a worker running two jobs at once with only two branch slots between them."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_MAX_CONCURRENT_REQUESTS="2",
                                 OPENJEV_MAX_CONCURRENT_BRANCHES="2") as stack:
        yield stack


def test_a_big_job_cannot_hold_back_another_jobs_branches(two_slot_stack: Stack) -> None:
    stack = two_slot_stack
    stack.script(delay=0.25)
    big = web.post(stack.url + "/v1/jobs", json=body({f"q{i}": NOUL for i in range(24)}), timeout=30).json()
    deadline = time.monotonic() + 30
    while big["id"] + ".1.b0" not in stack.engine_stats()["received"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the big job now holds both slots and 22 branches wait for them
    small = web.post(stack.url + "/v1/jobs", json=body({"only": NOUL}, state="another state"), timeout=30).json()
    for job in (small, big):
        done = web.get(f"{stack.url}/v1/jobs/{job['id']}", params={"wait": 30}, timeout=40).json()
        assert done["status"] == "succeeded", done
    order = stack.engine_stats()["received"]
    big_branches = [i for i, rid in enumerate(order) if rid.startswith(big["id"] + ".1.b")]
    small_branch = order.index(small["id"] + ".1.b0")
    # round-robin slots: the small job's branch goes next, ahead of most of the big job's branches
    # (a first-come queue would put it after all of them)
    assert sum(1 for i in big_branches if i > small_branch) >= 12
