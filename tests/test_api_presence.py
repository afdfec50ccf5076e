"""Sync jobs whose API process is gone, with real processes. A worker does not start the queued sync jobs of
an API that was killed (common/queue/presence.py: nobody is left to answer them), and starts those of a
live API however long they waited: the presence lasts 2 s here (20 s by default), so a job is looked at
once it waited 1.6 s; each engine call stalls 1 s and the worker runs one job at a time, so the jobs
queued behind the first wait that long. The worker's look at its queue ends them too, without waiting for a
slot to free. An API that stops (SIGTERM) and cuts its waiting sync requests
short (503, send it again) ends their jobs: none is left to run for nobody."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from common.queue import keys
from harness.stacks import Stack, isolated_scripted_stack
from tests.conftest import wait_for_next_heartbeat, wait_until
from tests.test_logs import events

pytestmark = pytest.mark.integration

ORPHANS = 5  # sync requests whose API is killed while the first of them runs


def body(state: str) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state,
            "questions": {"q": {"type": "noul", "instructions": "Is this a greeting?"}}}


def jobs_run(stack: Stack, since: int) -> set[str]:
    """The jobs whose warm call reached the engine after its `since`-th prompt (rids "<job>.<n>.warm")."""
    return {rid.rsplit(".", 2)[0] for rid in stack.engine_stats()["received"][since:] if rid.endswith(".warm")}


def idle_engine(stack: Stack) -> dict[str, Any] | None:
    """The engine's counters once no call is live in it."""
    stats = stack.engine_stats()
    return None if stats["live"] else stats


@pytest.fixture
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_API_PRESENCE_TTL="2",
                                 OPENJEV_MAX_CONCURRENT_REQUESTS="1") as stack:
        stack.script(delay=1.0)
        yield stack


def test_a_killed_apis_queued_sync_jobs_are_not_run_and_a_live_apis_are_however_long_they_waited(
        stack: Stack) -> None:
    with ThreadPoolExecutor(ORPHANS) as pool:
        # The API alive: three at once, the last waiting about 4 s for the one job slot, all answered.
        answered = list(pool.map(lambda i: stack.post(body(f"waited {i}"), timeout=60), range(3)))
        assert [r.status_code for r in answered] == [200] * 3, [r.text for r in answered]

        queue = keys.queue_name("w0")
        since = len(stack.engine_stats()["received"])
        with redis.Redis.from_url(stack.redis_url) as client:
            orphans = [pool.submit(stack.post, body(f"orphan {i}"), timeout=60) for i in range(ORPHANS)]
            wait_until(lambda: client.zcard(queue) == ORPHANS and jobs_run(stack, since), 30,
                       "every request queued, the first one in the engine")
            stack.api.stop(signal.SIGKILL)
            for orphan in orphans:
                with pytest.raises(httpx.TransportError):
                    orphan.result()
            wait_until(lambda: client.zcard(queue) == 0, 60, "the killed API's jobs run or taken off the queue")
            wait_for_next_heartbeat(stack.redis_url, "w0")
            counters = orjson.loads(client.get(keys.worker_key("w0")))["counters"]

    ran = jobs_run(stack, since)
    # The one in flight at the kill runs; one more may start before the killed API's presence lapses (2 s).
    assert 1 <= len(ran) <= 2, ran
    assert counters["endings"].get("gone") == ORPHANS - len(ran), counters["endings"]
    gone = [e for e in events(stack.workers[0].output()) if e.get("event") == "caller_gone"]
    assert len(gone) == ORPHANS - len(ran) and not {e["job_id"] for e in gone} & ran


def test_a_killed_apis_waiting_sync_jobs_leave_the_queue_while_the_worker_is_busy(model_dir: Path,
                                                                                  log_dir: Path) -> None:
    """The worker's look at its queue (every second here) ends them as soon as the API's presence has lapsed,
    before a slot frees for them: the backlog and the admission of new jobs stop counting them at once. The
    running job is not touched."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_API_PRESENCE_TTL="2", OPENJEV_WORKER_POLL_DELAY="1",
                                 OPENJEV_MAX_CONCURRENT_REQUESTS="1") as stack:
        stack.script(delay=10.0)  # the first job runs 20 s, well past the checks below
        queue = keys.queue_name("w0")
        with ThreadPoolExecutor(4) as pool, redis.Redis.from_url(stack.redis_url) as client:
            orphans = [pool.submit(stack.post, body(f"orphan {i}"), timeout=60) for i in range(4)]
            wait_until(lambda: client.zcard(queue) == 4 and stack.engine_stats()["live"], 30,
                       "four jobs queued, the first in the engine")
            stack.api.stop(signal.SIGKILL)
            running = stack.engine_stats()["live"]
            wait_until(lambda: client.zcard(queue) == 1, 15, "the three waiting jobs swept off the queue")
            assert stack.engine_stats()["live"] == running  # the running job is still in the engine
            assert client.zcard(keys.waiting_key(queue)) == 0
            wait_for_next_heartbeat(stack.redis_url, "w0")
            counters = orjson.loads(client.get(keys.worker_key("w0")))["counters"]
            assert counters["endings"].get("gone") == 3, counters["endings"]
            for orphan in orphans:
                with pytest.raises(httpx.TransportError):
                    orphan.result()


def test_a_stopping_api_ends_the_jobs_of_the_sync_requests_it_cuts_short(model_dir: Path, log_dir: Path) -> None:
    """The API's graceful shutdown waits 5 s for open requests; a job takes 8 s here, so all three are cut
    short: the running one is aborted in the engine and the two queued ones never start."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_MAX_CONCURRENT_REQUESTS="1") as stack:
        stack.script(delay=4.0)
        queue = keys.queue_name("w0")
        with ThreadPoolExecutor(3) as pool, redis.Redis.from_url(stack.redis_url) as client:
            cut = [pool.submit(stack.post, body(f"cut {i}"), timeout=60) for i in range(3)]
            wait_until(lambda: client.zcard(queue) == 3 and stack.engine_stats()["live"], 30,
                       "three jobs queued, the first in the engine")
            assert stack.api.stop(signal.SIGTERM, timeout=30) == 0
            answers = [future.result() for future in cut]
            assert [a.status_code for a in answers] == [503] * 3, [a.text for a in answers]
            assert all("send it again" in a.json()["detail"]["message"] for a in answers)
            wait_until(lambda: client.zcard(queue) == 0, 15, "the cut requests' jobs ended")
            stats = wait_until(lambda: idle_engine(stack), 15, "nothing live in the engine")
    assert len([rid for rid in stats["received"] if rid.endswith(".warm")]) == 1, stats  # the queued two never started
    assert stats["aborted"], stats  # and the running one was aborted, not run to its end
