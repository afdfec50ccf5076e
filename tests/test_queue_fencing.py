"""Fencing with real processes: a worker paused (SIGSTOP) past its lease has its jobs moved to a
live worker, which answers them; when the paused one resumes it must neither store an outcome nor
keep its engine calls going: each outcome is announced once, and the engine sees the paused
worker's calls aborted."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.queue import keys
from common.queue.membership import HEARTBEAT_INTERVAL, LIVENESS_WINDOW
from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, build_stack, final_statuses, stack_env
from harness.web import web
from openjev.embedded_redis import RedisServer
from tests.conftest import wait_until
from tests.test_api_contract import NOUL, body
from tests.test_logs import events

pytestmark = pytest.mark.integration

JOBS = 4
PAUSE = 12.0  # seconds: more than twice the lease, so the live worker surely moved the jobs


@pytest.fixture
def fenced_stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with fresh_redis() as redis_url:
        stack = build_stack(redis_url, start_scripted_engine(log_dir), model_dir, log_dir, OPENJEV_JOB_TIMEOUT="120")
        try:
            yield stack
        finally:
            stack.stop()


class Notices:
    """Counts the completion notices per job id while the test runs."""

    def __init__(self, redis_url: str) -> None:
        self.counts: Counter[str] = Counter()
        self._pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(keys.DONE_CHANNEL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message:
                self.counts[message["data"].decode().partition(" ")[0]] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()


def ended_on(worker: Proc, job_id: str) -> bool:
    """Whether `worker`'s log shows its placement of `job_id` ended: stopped (moved or cancelled), or a
    job event (stored or refused). Any store it tried comes before that line."""
    text = worker.output()
    return f'"job {job_id}: ' in text or any(e.get("event") == "job" and e.get("job_id") == job_id
                                             for e in events(text))


def wait_for_notices(notices: Notices, redis_url: str) -> None:
    """Until every notice published so far has reached `notices`: Redis delivers a channel's messages in
    the order it took them, so once a marker published now is counted, all earlier ones are."""
    marker = f"marker-{time.monotonic_ns()}"
    with redis.Redis.from_url(redis_url) as client:
        client.publish(keys.DONE_CHANNEL, marker)
    wait_until(lambda: notices.counts[marker], 10, "a marker published on the done channel heard")


def test_a_worker_paused_past_its_lease_stores_nothing_and_its_engine_calls_are_aborted(
        fenced_stack: Stack) -> None:
    stack = fenced_stack
    stack.script(slow_rid_infix=".1.", slow_delay=300.0)  # first placements (on w0) stall; moved ones do not
    notices = Notices(stack.redis_url)
    try:
        ids = [web.post(stack.url + "/v1/jobs", json=body({"a": NOUL}, state=f"state {i}"), timeout=30).json()["id"]
               for i in range(JOBS)]
        wait_until(lambda: all(f"{i}.1.warm" in stack.engine_stats()["live"] for i in ids), 30,
                 "every job's warm call live on w0")
        stack.workers.append(start_worker(stack.log_dir, stack.env, stack.engine.url, "w1"))
        wait_until(lambda: len(web.get(stack.url + "/health", timeout=5).json()["workers"]) == 2, 60, "w1 live")

        paused = stack.workers[0].process
        paused.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        with redis.Redis.from_url(stack.redis_url) as client:  # what w0's lease had left as it froze
            lease_left = client.pttl(keys.lease_key("w0")) / 1000
        assert LIVENESS_WINDOW - 2 * HEARTBEAT_INTERVAL < lease_left <= LIVENESS_WINDOW  # renewed by its busy beat
        try:
            for job_id in ids:
                done = web.get(f"{stack.url}/v1/jobs/{job_id}", params={"wait": 30}, timeout=40).json()
                assert done["status"] == "succeeded", done
            assert time.monotonic() - stopped_at > lease_left  # answered only once w0's lease had lapsed
            time.sleep(max(0.0, PAUSE - (time.monotonic() - stopped_at)))  # the pause itself: PAUSE s in all
        finally:
            paused.send_signal(signal.SIGCONT)

        def first_placements_ended() -> dict | None:
            stats = stack.engine_stats()
            return None if any(".1." in rid for rid in stats["live"]) else stats

        stats = wait_until(first_placements_ended, 15, "the paused worker's calls ended")
        assert {f"{i}.1.warm" for i in ids} <= set(stats["aborted"])  # aborted, not left to run out
        assert not any(r.startswith(tuple(ids)) and ".1." in r for r in stats["finished"])
        wait_until(lambda: all(ended_on(stack.workers[0], i) for i in ids), 30,
                   "the paused worker's log shows each first placement ended")  # after any store it tried
        wait_for_notices(notices, stack.redis_url)
        assert {i: notices.counts[i] for i in ids} == {i: 1 for i in ids}  # each outcome stored once
        for job_id in ids:
            record = redis.Redis.from_url(stack.redis_url).hgetall(keys.job_key(job_id))
            assert record[b"status"] == b"succeeded" and record[b"placement"] == f"{job_id}.2".encode()
        assert stack.workers[0].alive()  # it rejoined with a new lease rather than running on a lapsed one
        assert "lease_lapsed" in stack.workers[0].output()
    finally:
        notices.close()
        stack.script(slow_rid_infix=None, slow_delay=0.0)


def test_after_a_redis_outage_the_first_worker_back_moves_only_a_dead_workers_jobs(
        model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    """Redis away past the lease (every worker's lapses alike), two workers with queued jobs: one worker that
    beats again 3 s after Redis returns keeps its jobs (the other gives it a liveness window after its own
    return before it takes silence for death); one killed during a second outage has its jobs moved."""
    server = RedisServer.on(tmp_path / "redis")
    server.start()
    server.wait_ready()
    engine = start_scripted_engine(log_dir)
    assert engine.url
    env = stack_env(server.url, model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS="2", OPENJEV_JOB_TIMEOUT="300")
    w1, w2 = start_worker(log_dir, env, engine.url, "w1"), start_worker(log_dir, env, engine.url, "w2")
    api = start_api(log_dir, env)
    try:
        web.post(f"{engine.url}/script", json={"delay": 0.3}, timeout=5).raise_for_status()

        def queue_jobs(round_: int) -> list[str]:
            """Async jobs until both workers have some queued; their ids."""
            ids = []
            for i in range(200):
                r = web.post(api.url + "/v1/jobs", json=body({"q": NOUL}, state=f"Round {round_}, ticket {i}"),
                             timeout=30)
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
                if len(ids) >= 20 and all(queued(server.url, w) >= 3 for w in ("w1", "w2")):
                    return ids
            raise AssertionError("the jobs did not spread over both workers")

        def outage() -> None:
            """Redis away for longer than a lease (LIVENESS_WINDOW), as a restart on its data dir would be."""
            server.stop()
            down = time.monotonic()
            while time.monotonic() - down < LIVENESS_WINDOW + 2:  # the outage itself is what is tested
                time.sleep(0.1)

        first = queue_jobs(1)
        outage()
        w2.process.send_signal(signal.SIGSTOP)  # w2 comes back late: 3 s after Redis
        server.start()
        server.wait_ready()
        returned = time.monotonic()
        try:
            while time.monotonic() - returned < 3.0:
                time.sleep(0.1)
        finally:
            w2.process.send_signal(signal.SIGCONT)
        assert final_statuses(api.url, first) == ["succeeded"] * len(first)
        assert "from vanished worker w2" not in w1.output(), w1.output()[-2000:]

        web.post(f"{engine.url}/script", json={"delay": 2.0}, timeout=5).raise_for_status()
        second = queue_jobs(2)
        outage()
        w2.process.kill()  # dies during the outage: its jobs must still move once Redis returns
        w2.process.wait(10)
        server.start()
        server.wait_ready()
        web.post(f"{engine.url}/script", json={"delay": 0.05}, timeout=5).raise_for_status()
        wait_until(lambda: "from vanished worker w2" in w1.output(), 30, "w1 moving the dead w2's jobs")
        assert final_statuses(api.url, second) == ["succeeded"] * len(second)
    finally:
        for proc in (api, w1, w2, engine):
            proc.stop()
        server.stop()


def queued(redis_url: str, worker_id: str) -> int:
    with redis.Redis.from_url(redis_url) as client:
        return client.zcard(keys.queue_name(worker_id))
