"""A fleet on one Redis: two API processes and three workers (one job at a time each), each beside
its own scripted engine. The same prefix lands on the same worker whichever API receives it, and
spills to its second choice only once jobs wait on the first; a worker that dies leaves the routing
set within the liveness window, its prefixes go to their second choice, and the jobs it held are
answered once by another worker."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from api.preparation import JobPreparer
from common.contract import SystemOneRequest
from common.jobs import JobSpec
from common.prompt import PromptCompiler
from common.queue import keys
from common.queue.membership import HEARTBEAT_INTERVAL, LIVENESS_WINDOW
from common.routing import rank_workers
from common.settings import Settings
from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.stacks import stack_env
from harness.web import web
from tests.conftest import wait_for_next_heartbeat

WORKER_IDS = ["f0", "f1", "f2"]
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
             "criteria": {"Billing": "Payments, invoices, refunds", "Technical": "Bugs, outages"}},
}
LEAVES_WITHIN = LIVENESS_WINDOW + HEARTBEAT_INTERVAL + 0.5  # seconds from a kill to leaving the routing set


def request_for(state: str) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state, "questions": QUESTIONS}


@dataclass
class Fleet:
    """The running processes, and what the test reads from them."""

    redis: redis.Redis
    apis: list[Proc]
    engines: dict[str, Proc]  # by worker id
    workers: dict[str, Proc]
    env: dict[str, str]
    log_dir: Path
    preparer: JobPreparer

    def job(self, state: str) -> JobSpec:
        """The job an API makes of `state`, prepared here by the same code."""
        return self.preparer.prepare(SystemOneRequest.model_validate(request_for(state)), "req_test", 60)

    def ranking(self, state: str) -> list[str]:
        """The workers, best first, for `state`'s prefix: what every API must compute."""
        return rank_workers(self.job(state).prefix_hash, WORKER_IDS)

    def submit(self, state: str, api: int = 0) -> str:
        r = web.post(f"{self.apis[api].url}/v1/jobs", json=request_for(state), timeout=30)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def outcome(self, job_id: str, api: int = 0, wait: float = 30.0) -> dict[str, Any]:
        r = web.get(f"{self.apis[api].url}/v1/jobs/{job_id}", params={"wait": wait}, timeout=wait + 10)
        assert r.status_code == 200, r.text
        return r.json()

    def record(self, job_id: str) -> dict[str, str]:
        """The job's status record in Redis: `queue` it was put on, `worker` that ran it."""
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(keys.job_key(job_id)).items()}

    def run(self, state: str, api: int = 0) -> str:
        """Submit `state` and wait for its answer; the worker that ran it."""
        job_id = self.submit(state, api)
        assert self.outcome(job_id, api)["status"] == "succeeded"
        return self.record(job_id)["worker"]

    def wait_running(self, job_id: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.record(job_id)["status"] != "running":
            assert time.monotonic() < deadline, f"{job_id} never started"
            time.sleep(0.05)

    def cancel_all(self, worker_id: str) -> None:
        """Cancel every job on the worker's queue (its engine's stalled calls are aborted)."""
        for arq_job_id in self.redis.zrange(keys.queue_name(worker_id), 0, -1):
            job_id = keys.job_of(arq_job_id.decode())
            web.delete(f"{self.apis[0].url}/v1/jobs/{job_id}", timeout=10).raise_for_status()

    def live(self, api: int = 0) -> dict[str, dict[str, Any]]:
        """The routing set as an API reports it in /v1/limits, by worker id."""
        workers = web.get(f"{self.apis[api].url}/v1/limits", timeout=5).json()["workers"]
        return {w["id"]: w for w in workers}

    def wait_live(self, expected: set[str], timeout: float) -> float:
        """Seconds until the routing set is `expected` in both APIs' view."""
        started = time.monotonic()
        while not all(set(self.live(api)) == expected for api in (0, 1)):
            assert time.monotonic() - started < timeout, f"routing set is {set(self.live())}, not {expected}"
            time.sleep(0.1)
        return time.monotonic() - started

    def engine_stats(self, worker_id: str) -> dict[str, Any]:
        return web.get(f"{self.engines[worker_id].url}/stats", timeout=5).json()

    def script(self, worker_id: str, **settings: Any) -> None:
        web.post(f"{self.engines[worker_id].url}/script", json=settings, timeout=5).raise_for_status()

    def abort_stalled(self, worker_id: str) -> None:
        """Abort the calls a killed worker left stalled in its engine (nobody else knows their rids)."""
        for rid in self.engine_stats(worker_id)["live"]:
            web.post(f"{self.engines[worker_id].url}/abort_request", json={"rid": rid}, timeout=5)

    def restart(self, worker_id: str) -> None:
        """Start a worker with the id of one that was killed and wait until it is routed to again."""
        self.workers[worker_id] = start_worker(self.log_dir, self.env, self.engines[worker_id].url or "", worker_id)
        self.wait_live(set(WORKER_IDS), timeout=4 * LIVENESS_WINDOW + 30)


@pytest.fixture(scope="module")
def fleet(redis_server: str, model_dir: Path, log_dir: Path, smollm2_compiler: PromptCompiler) -> Iterator[Fleet]:
    env = stack_env(redis_server, model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS="1")
    engines = {w: start_scripted_engine(log_dir) for w in WORKER_IDS}
    workers = {w: start_worker(log_dir, env, engines[w].url or "", w) for w in WORKER_IDS}
    apis: list[Proc] = []
    client = redis.Redis.from_url(redis_server)
    fleet = Fleet(client, apis, engines, workers, env, log_dir, JobPreparer(Settings(), smollm2_compiler))
    try:
        apis += [start_api(log_dir, env), start_api(log_dir, env)]
        fleet.wait_live(set(WORKER_IDS), timeout=60)
        yield fleet
    finally:
        for proc in [*apis, *fleet.workers.values(), *engines.values()]:
            proc.stop()
        client.close()


def states_led_by(fleet: Fleet, worker_ids: list[str]) -> list[str]:
    """One state per worker in `worker_ids` whose prefix ranks that worker first."""
    found: dict[str, str] = {}
    for i in range(200):
        state = f"Ticket {i}: I was charged twice for my March invoice; please refund the duplicate."
        found.setdefault(fleet.ranking(state)[0], state)
        if set(worker_ids) <= set(found):
            return [found[w] for w in worker_ids]
    raise AssertionError("no state found for some worker")


def test_the_same_prefix_lands_on_its_first_choice_from_either_api(fleet: Fleet) -> None:
    for first, state in zip(WORKER_IDS, states_led_by(fleet, WORKER_IDS), strict=True):
        before = {w: fleet.engine_stats(w)["requests_finished"] for w in WORKER_IDS}
        assert [fleet.run(state, api=i % 2) for i in range(4)] == [first] * 4
        after = {w: fleet.engine_stats(w)["requests_finished"] for w in WORKER_IDS}
        calls = 4 * (1 + len(QUESTIONS))  # a warm call and one branch per question, per request
        assert {w: after[w] - before[w] for w in WORKER_IDS} == {w: calls if w == first else 0 for w in WORKER_IDS}


def test_each_workers_cache_hits_are_published_and_match_its_engine(fleet: Fleet) -> None:
    state = "Order 5521: the parcel arrived broken and I want a replacement, not a refund."
    first = fleet.ranking(state)[0]
    prefix = len(fleet.job(state).prefix_ids)
    # each read is of a heartbeat made after every earlier job had ended: the counters include them all
    wait_for_next_heartbeat(fleet.env["OPENJEV_REDIS_URL"], first)
    before, engine_before = fleet.live(1)[first]["counters"], fleet.engine_stats(first)
    assert [fleet.run(state, api=i) for i in (0, 1)] == [first, first]
    wait_for_next_heartbeat(fleet.env["OPENJEV_REDIS_URL"], first)
    after, engine_after = fleet.live(1)[first]["counters"], fleet.engine_stats(first)
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    assert (delta["jobs_done"], delta["warm_calls"], delta["branch_calls"]) == (2, 2, 2 * len(QUESTIONS))
    assert delta["warm_cached_tokens"] >= prefix - 1  # the second warm call found the state cached here
    assert delta["branch_cached_tokens"] >= 2 * len(QUESTIONS) * prefix  # every branch reused its warm call
    engine_prompt = engine_after["prompt_tokens"] - engine_before["prompt_tokens"]
    engine_cached = engine_after["cached_tokens"] - engine_before["cached_tokens"]
    assert delta["warm_prompt_tokens"] + delta["branch_prompt_tokens"] == engine_prompt
    assert delta["warm_cached_tokens"] + delta["branch_cached_tokens"] == engine_cached
    assert fleet.live(0)[first]["branch_hit_ratio"] == pytest.approx(after["branch_cached_tokens"]
                                                                     / after["branch_prompt_tokens"])


def test_a_hot_prefix_spills_to_its_second_choice_only_once_jobs_wait_on_its_first(fleet: Fleet) -> None:
    state = "Ticket 7070: every export since Tuesday has the wrong currency on it."
    first, second, _ = fleet.ranking(state)
    fleet.script(first, delay=60.0)  # its one slot stays busy
    try:
        running = fleet.submit(state, api=0)
        fleet.wait_running(running)
        waiting = fleet.submit(state, api=1)  # nothing waits anywhere yet: bound ⌈1.25 · 1/3⌉ = 1 holds it
        spilled = fleet.submit(state, api=0)  # one waits on the first: 1 + 1 > ⌈1.25 · 2/3⌉ = 1
        queues = [fleet.record(j)["queue"] for j in (running, waiting, spilled)]
        assert queues == [keys.queue_name(w) for w in (first, first, second)]
        assert fleet.outcome(spilled, api=1)["status"] == "succeeded"
        assert fleet.record(spilled)["worker"] == second
    finally:
        fleet.cancel_all(first)
        fleet.script(first, delay=0.0)


def test_killing_a_prefixs_worker_moves_it_to_its_second_choice_and_its_queued_job_too(fleet: Fleet) -> None:
    state = "Ticket 9001: our whole team is locked out since the password reset this morning."
    first, second, _ = fleet.ranking(state)
    assert fleet.run(state) == first
    fleet.workers[first].kill()
    stranded = fleet.submit(state, api=1)  # the dead worker is still in the routing set: its queue takes it
    assert fleet.record(stranded)["queue"] == keys.queue_name(first)
    assert fleet.wait_live(set(WORKER_IDS) - {first}, timeout=LEAVES_WITHIN) <= LEAVES_WITHIN
    assert [fleet.run(state, api=i) for i in (0, 1)] == [second, second]
    assert fleet.outcome(stranded, api=0)["status"] == "succeeded"
    assert fleet.record(stranded)["worker"] == second
    fleet.restart(first)
    assert fleet.run(state, api=1) == first  # back in the routing set, it gets its prefixes back


def test_a_job_running_on_a_worker_that_dies_is_answered_once_by_the_next_in_its_ranking(fleet: Fleet) -> None:
    state = "Ticket 4242: the invoice PDF shows the wrong VAT number for our company."
    first, second, _ = fleet.ranking(state)
    fleet.script(first, delay=60.0)  # the engine stalls: the job stays in the worker's hands
    try:
        job_id = fleet.submit(state)
        fleet.wait_running(job_id)
        assert fleet.record(job_id)["worker"] == first
        second_before = fleet.engine_stats(second)["requests_finished"]
        fleet.workers[first].kill()
        assert fleet.outcome(job_id, api=1)["status"] == "succeeded"
        assert fleet.record(job_id)["worker"] == second
        assert fleet.engine_stats(second)["requests_finished"] - second_before == 1 + len(QUESTIONS)  # run once
    finally:
        fleet.script(first, delay=0.0)
        fleet.abort_stalled(first)
    fleet.restart(first)


def test_a_worker_with_a_slow_health_route_keeps_its_lease_and_its_running_job(fleet: Fleet) -> None:
    """Each health check takes its 5 s timeout, so heartbeats go stale; the lease is renewed on its
    own schedule all the same, so no other worker may move the job and run it a second time."""
    state = "Ticket 3131: the SSO login loops back to the start page for every new employee."
    first, *others = fleet.ranking(state)
    fleet.script(first, delay=5.0)  # warm call + branches: a job of ~10 s
    try:
        job_id = fleet.submit(state)
        fleet.wait_running(job_id)
        before = {w: fleet.engine_stats(w)["requests_received"] for w in others}
        fleet.script(first, health_delay=5.5)
        lease_left = []  # ms before the lease would lapse, sampled while the job runs
        while fleet.record(job_id)["status"] == "running":
            lease_left.append(fleet.redis.pttl(keys.lease_key(first)))
            time.sleep(0.1)
        fleet.script(first, health_delay=0.0)  # before a third failed check makes the worker give up
        assert len(lease_left) > 50 and min(lease_left) > 2000, min(lease_left)
        assert fleet.outcome(job_id)["status"] == "succeeded"
        assert fleet.record(job_id)["worker"] == first
        assert {w: fleet.engine_stats(w)["requests_received"] for w in others} == before  # run once, here
    finally:
        fleet.script(first, delay=0.0, health_delay=0.0)
    fleet.wait_live(set(WORKER_IDS), timeout=LEAVES_WITHIN + 10)


@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "0"], "must be at least 1"),
    (["--workers", "2", "--connect", "http://127.0.0.1:30000"], "runs N CPU engines"),
])
def test_serve_refuses_a_fleet_it_cannot_build(args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, "-m", "openjev", "serve", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert message in run.stderr
