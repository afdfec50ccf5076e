"""An engine's failure costs no job: a call the engine could not answer (a 5xx, a reset connection, no
answer within the call limit, the engine killed) runs the job again, on the other worker's engine or on
the same one once it answers again, a bounded number of times, with its attempts in the job's record;
a 4xx (the request's own fault) fails it at once. Real API, Redis and worker processes around scripted
engines at the HTTP boundary; the engine crash under `openjev serve` with the CPU engine is in
tests/test_faults.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from common.queue import keys
from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, isolated_scripted_stack, stack_env
from harness.web import web
from worker.evaluation import MAX_RUNS

pytestmark = pytest.mark.integration

CALL_LIMIT = 2.0  # seconds an engine call may go unanswered before the engine counts as hung
HEALTH_INTERVAL = 0.5  # seconds between a worker's engine probes
JOB_TIMEOUT = 60.0
ONE_QUESTION = {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}


def body(state: str) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state, "questions": ONE_QUESTION}


@dataclass
class Fleet:
    """Redis, one API, and two workers (w-a, w-b), each beside its own scripted engine."""

    redis_url: str
    api: Proc
    engines: dict[str, Proc]
    workers: dict[str, Proc]
    env: dict[str, str]
    log_dir: Path
    extra: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.api.url
        return self.api.url

    def script(self, worker_id: str, **settings: Any) -> None:
        web.post(f"{self.engines[worker_id].url}/script", json=settings, timeout=5).raise_for_status()

    def stats(self, worker_id: str) -> dict[str, Any]:
        return web.get(f"{self.engines[worker_id].url}/stats", timeout=5).json()

    def submit(self, state: str) -> str:
        response = web.post(self.url + "/v1/jobs", json=body(state), timeout=30)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def wait(self, job_id: str, timeout: float = JOB_TIMEOUT + 15) -> dict[str, Any]:
        """The job's view once it ended (GET ?wait= until then, bounded by its deadline and a margin)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = web.get(f"{self.url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=20).json()
            if view["status"] not in ("queued", "running"):
                return view
        raise AssertionError(f"job {job_id} still pending past its deadline")

    def record(self, job_id: str) -> dict[str, str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return {k.decode(): v.decode() for k, v in client.hgetall(keys.job_key(job_id)).items()}
        finally:
            client.close()

    def wait_routable_since(self, since: float, *worker_ids: str, timeout: float = 30.0) -> None:
        """Until each worker's heartbeat, sent after a probe begun after `since` (epoch seconds), says
        its engine is up: an earlier heartbeat may still carry an earlier test's failure."""
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                beats = [(client.zscore(keys.WORKERS, w), client.get(keys.worker_key(w))) for w in worker_ids]
                if all(at and at > since + HEALTH_INTERVAL + 0.5 and raw and orjson.loads(raw)["engine_ok"]
                       for at, raw in beats):
                    return
                assert time.monotonic() < deadline, f"{worker_ids} not routable within {timeout:g} s"
                time.sleep(0.1)
        finally:
            client.close()

    def wait_live(self, *worker_ids: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            workers = web.get(self.url + "/health", timeout=10).json()["workers"]
            if set(worker_ids) <= {w["id"] for w in workers if w["engine_ok"]}:
                return
            assert time.monotonic() < deadline, f"{worker_ids} not live within {timeout:g} s"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, log_dir: Path) -> Iterator[Fleet]:
    with fresh_redis() as redis_url:
        env = stack_env(redis_url, model_dir, OPENJEV_ENGINE_CALL_LIMIT=str(CALL_LIMIT),
                        OPENJEV_JOB_TIMEOUT=str(JOB_TIMEOUT), OPENJEV_REQUEST_TIMEOUT="30",
                        OPENJEV_WORKER_POLL_DELAY="0.5", OPENJEV_ENGINE_HEALTH_INTERVAL=str(HEALTH_INTERVAL))
        engines = {w: start_scripted_engine(log_dir) for w in ("w-a", "w-b")}
        workers = {w: start_worker(log_dir, env, engine.url or "", w) for w, engine in engines.items()}
        api = start_api(log_dir, env)
        fleet = Fleet(redis_url, api, engines, workers, env, log_dir)
        try:
            fleet.wait_live("w-a", "w-b")
            yield fleet
        finally:
            for proc in [api, *workers.values(), *fleet.extra, *engines.values()]:
                proc.stop()


@pytest.fixture(autouse=True)
def _honest_engines(fleet: Fleet) -> Iterator[None]:
    for worker_id in fleet.engines:
        fleet.script(worker_id, delay=0.0, fail_rid_suffix=None, fail_status=500, fail_times=None)
    fleet.wait_routable_since(time.time(), "w-a", "w-b")  # an earlier test's failures took workers out
    yield


def spread(fleet: Fleet, count: int, tag: str) -> list[str]:
    """`count` async jobs on different states, so both workers get some."""
    return [fleet.submit(f"{tag}: ticket {i}, please have a look.") for i in range(count)]


def test_an_engine_5xx_runs_the_job_again_on_the_other_workers_engine(fleet: Fleet) -> None:
    fleet.script("w-a", fail_rid_suffix=".warm", fail_status=500)
    jobs = spread(fleet, 10, "5xx")
    views = {job_id: fleet.wait(job_id) for job_id in jobs}
    assert [v["status"] for v in views.values()] == ["succeeded"] * len(jobs), views
    rerun = [job_id for job_id, view in views.items() if view.get("attempts")]
    assert rerun, "no job was routed to the failing engine"  # 10 states: each goes to w-a with odds 1/2
    for job_id in rerun:
        record = fleet.record(job_id)
        assert views[job_id]["attempts"] == 2 == int(record["attempts"])
        assert record["last_failure"].startswith("w-a: engine answered 500")
        assert orjson.loads(record["outcome"])["worker_id"] == "w-b"
        assert set(views[job_id]["result"]["answers"]) == {"refund"}
    assert all("attempts" not in view for job_id, view in views.items() if job_id not in rerun)


def test_an_engine_4xx_fails_the_job_at_once_and_it_is_not_run_again(fleet: Fleet) -> None:
    for worker_id in fleet.engines:
        fleet.script(worker_id, fail_rid_suffix=".warm", fail_status=400)
    before = sum(fleet.stats(w)["requests_received"] for w in fleet.engines)
    started = time.monotonic()
    response = web.post(fleet.url + "/v1/systemone", json=body("A prompt the engine refuses."), timeout=40)
    assert response.status_code == 502, response.text
    assert response.json()["detail"]["error_type"] == "engine_error"
    assert time.monotonic() - started < 5.0
    assert sum(fleet.stats(w)["requests_received"] for w in fleet.engines) - before == 1  # one warm call, once


def test_an_engine_that_keeps_failing_fails_the_job_after_max_runs(fleet: Fleet) -> None:
    for worker_id in fleet.engines:
        fleet.script(worker_id, fail_rid_suffix=".warm", fail_status=503)
    before = sum(fleet.stats(w)["requests_received"] for w in fleet.engines)
    view = fleet.wait(fleet.submit("Every engine answers 503."))
    assert view["status"] == "failed", view
    assert view["error"]["error_type"] == "engine_error"
    assert f"attempt {MAX_RUNS} of {MAX_RUNS}" in view["error"]["message"]
    assert view["attempts"] == MAX_RUNS
    assert sum(fleet.stats(w)["requests_received"] for w in fleet.engines) - before == MAX_RUNS


def test_a_hung_engine_call_is_aborted_and_the_job_runs_again_on_the_other_engine(fleet: Fleet) -> None:
    fleet.script("w-a", delay=600.0)  # accepts every call and never answers (until aborted)
    jobs = spread(fleet, 8, "hung")
    views = {job_id: fleet.wait(job_id) for job_id in jobs}
    assert [v["status"] for v in views.values()] == ["succeeded"] * len(jobs), views
    rerun = [job_id for job_id, view in views.items() if view.get("attempts")]
    assert rerun, "no job was routed to the hung engine"
    for job_id in rerun:
        record = fleet.record(job_id)
        assert f"no answer within {CALL_LIMIT:g} s" in record["last_failure"]
        assert orjson.loads(record["outcome"])["worker_id"] == "w-b"
    hung = fleet.stats("w-a")
    assert hung["live"] == []  # every hung call was aborted, none left holding the engine
    assert hung["requests_aborted"] >= len(rerun)


def test_a_killed_engine_costs_no_job_the_other_worker_runs_them(fleet: Fleet, log_dir: Path) -> None:
    doomed = start_scripted_engine(log_dir)
    fleet.extra.append(doomed)
    fleet.engines["w-c"] = doomed
    worker = start_worker(log_dir, fleet.env, doomed.url or "", "w-c")
    fleet.extra.append(worker)
    fleet.wait_live("w-c")
    fleet.script("w-c", delay=3.0)  # its calls are in flight when it dies
    jobs = spread(fleet, 12, "killed")
    deadline = time.monotonic() + 20
    while not fleet.stats("w-c")["live"]:
        assert time.monotonic() < deadline, "no call reached the engine about to be killed"
        time.sleep(0.05)
    doomed.kill()
    del fleet.engines["w-c"]
    views = {job_id: fleet.wait(job_id) for job_id in jobs}
    assert [v["status"] for v in views.values()] == ["succeeded"] * len(jobs), views
    rerun = [fleet.record(job_id) for job_id, view in views.items() if view.get("attempts")]
    # A call in flight when the engine dies fails as unreachable; on a loaded machine one may have been in
    # flight past the call limit before the kill came, and failed as hung first: either way, w-c's engine.
    assert rerun and all(r["last_failure"].startswith("w-c: engine unreachable")
                         or (r["last_failure"].startswith("w-c: engine call")
                             and r["last_failure"].endswith(f"got no answer within {CALL_LIMIT:g} s")) for r in rerun)
    assert all(orjson.loads(r["outcome"])["worker_id"] in ("w-a", "w-b") for r in rerun)
    assert worker.process.wait(30) == 3  # its engine is down: the worker stops, as before


@pytest.fixture
def lone(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_WORKER_POLL_DELAY="0.5") as stack:
        yield stack


def test_a_lone_worker_runs_the_job_again_once_its_engine_answers_again(lone: Stack) -> None:
    lone.script(fail_rid_suffix=".warm", fail_status=502, fail_times=2)  # two calls fail, then it recovers
    started = time.monotonic()
    response = lone.post(body("The engine fails twice, then answers."))
    assert response.status_code == 200, response.text
    assert response.headers["x-openjev-attempts"] == "3"
    assert set(response.json()["answers"]) == {"refund"}
    assert time.monotonic() - started < 15  # run again at once, then after 1 s: not at its deadline
    warm = [rid for rid in lone.engine_stats()["received"] if rid.endswith(".warm")]
    assert len(warm) == 3 and len({rid.rsplit(".", 1)[0] for rid in warm}) == 3  # three placements
