"""Redis under Sentinel: one master, one replica and three Sentinels, all real local processes (the
redis-server binary in Sentinel mode). The master is killed with -9 while async jobs are queued and
running; the API and the worker follow the master the Sentinels promote, without a restart, and every
accepted job is answered once. A 202 and a stored outcome wait for the replica's copy (WAIT)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common.queue import keys
from common.queue.replication import ReplicaCopy
from common.redis_connection import redis_connection
from common.settings import Settings
from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.sentinels import SentinelGroup, settings_for
from harness.stacks import answered, final_statuses, stack_env
from harness.web import web
from tests.test_api_contract import NOUL, body
from tests.test_logs import events

pytestmark = pytest.mark.integration

JOBS = 30
RUNNING_AT_ONCE = 4  # the worker's slots: the rest of the jobs wait in its queue
ENGINE_DELAY = 1.0  # seconds each engine call stalls: at the kill, jobs are running and most are queued
ANSWERED_WITHIN = 10.0  # seconds from the master's death to a new request's 202 (issue 32's target)
# Seconds from the Sentinels' promotion to a new request's 202: what holds when their first election stalls
# (it then takes 2 × failover-timeout more, bench/sentinel_election.py), which is theirs, not openjev's. Here
# with the first candidate stopped: promoted after 7.5 s, accepted 1.8 s later (the worker's heartbeat had to
# reach the new master first).
FOLLOWS_WITHIN = 5.0


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup(tmp_path)
    try:
        group.wait_ready()
        yield group
    finally:
        group.stop()


def test_a_client_built_from_the_settings_follows_the_sentinels_to_the_new_master(
        sentinel_group: SentinelGroup) -> None:
    async def scenario() -> None:
        client = redis_connection(settings_for(sentinel_group))
        try:
            assert await client.set("before", b"1")
            sentinel_group.master.send_signal(signal.SIGKILL)
            sentinel_group.master.wait(10)
            deadline = time.monotonic() + 30
            while True:  # a client with no retry: each failed command is one 503, until the promotion
                try:
                    assert await client.get("before") == b"1"
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    assert time.monotonic() < deadline, "never reached the promoted replica"
                    await asyncio.sleep(0.1)
            assert (await client.info("server"))["tcp_port"] == sentinel_group.replica_port
            # The client asked whichever Sentinel answered first; the one current_master() asks names the
            # promoted replica too once the Sentinels have converged (CI saw it still name the old master).
            deadline = time.monotonic() + 10
            while sentinel_group.current_master() != sentinel_group.replica_port:
                assert time.monotonic() < deadline, "the Sentinels never agreed on the promoted replica"
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_promise_waits_for_the_replicas_copy_bounded_and_logged(sentinel_group: SentinelGroup,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    replica = sentinel_group.client(sentinel_group.replica_port)

    async def scenario() -> tuple[bool, bool, float, float, bool, float]:
        client = redis_connection(settings_for(sentinel_group))
        try:
            assert not replica.exists(keys.REPLICATION_MARK)
            copied = await ReplicaCopy(client).wait()
            assert replica.exists(keys.REPLICATION_MARK)  # confirmed: the replica holds the mark
            # A replica that stops answering stays connected: WAIT blocks, up to the bound; then the promises
            # of the next 1.5 s go without waiting, and the first after them waits again.
            lagging = ReplicaCopy(client, timeout=1.0, lagging_recheck=1.5)
            sentinel_group.replica.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                stalled = await lagging.wait()
                waited = time.monotonic() - started
                started = time.monotonic()
                assert [await lagging.wait() for _ in range(5)] == [False] * 5
                skipped_in = time.monotonic() - started
            finally:
                sentinel_group.replica.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 10
            while not await lagging.wait():  # at once while the window lasts, then a wait the replica confirms
                assert time.monotonic() < deadline, "the replica never confirmed a write again"
                await asyncio.sleep(0.05)
            replica.shutdown(nosave=True)
            deadline = time.monotonic() + 10
            while (await client.info("replication"))["connected_slaves"]:
                assert time.monotonic() < deadline, "the master still counts its replica"
                await asyncio.sleep(0.05)
            started = time.monotonic()
            alone = await ReplicaCopy(client, timeout=5.0).wait()
            return copied, stalled, waited, skipped_in, alone, time.monotonic() - started
        finally:
            await client.aclose()

    with caplog.at_level(logging.INFO, logger="openjev.queue"):
        copied, stalled, waited, skipped_in, alone, alone_waited = asyncio.run(scenario())
    assert copied
    assert not stalled and 1.0 <= waited < 3.0
    assert skipped_in < 0.5  # five promises, none of which waited
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == ("no replica confirmed a write within 1.0 s; the promise is given anyway, and those of "
                           "the next 1.5 s without waiting")
    assert len(messages) == 2 and messages[1].startswith("a replica confirms writes again; "), messages
    assert int(messages[1].split("; ")[1].split()[0]) >= 5  # the five above, and the loop's while the window lasted
    assert not alone and alone_waited < 1.0  # no replica: one INFO, no WAIT


class FailoverStack:
    """The scripted engine, one worker and an API on the Sentinel group."""

    def __init__(self, group: SentinelGroup, log_dir: Path, model_dir: Path) -> None:
        self.group = group
        self.engine = start_scripted_engine(log_dir)
        assert self.engine.url
        env = {**stack_env("", model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS=str(RUNNING_AT_ONCE),
                           OPENJEV_JOB_TIMEOUT="300"), **group.env()}
        self.worker = start_worker(log_dir, env, self.engine.url, "w-sentinel")
        self.api = start_api(log_dir, env)
        assert self.api.url
        self.url = self.api.url

    def script(self, **settings: Any) -> None:
        web.post(f"{self.engine.url}/script", json=settings, timeout=5).raise_for_status()

    def submit(self, i: int) -> httpx.Response:
        return web.post(self.url + "/v1/jobs", json=body({"q": NOUL}, state=f"Ticket {i}: refund?"), timeout=30)

    def stop(self) -> None:
        for proc in (self.api, self.worker, self.engine):
            proc.stop()


@pytest.fixture
def failover_stack(sentinel_group: SentinelGroup, log_dir: Path, model_dir: Path) -> Iterator[FailoverStack]:
    stack = FailoverStack(sentinel_group, log_dir, model_dir)
    yield stack
    stack.stop()


def stored_outcomes(worker: Proc) -> Counter[str]:
    """How many times the worker stored an outcome, per job id (one log event per stored outcome)."""
    stored: Counter[str] = Counter()
    for line in worker.output().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "job" and entry.get("message") != "job refused":
            stored[entry["job_id"]] += 1
    return stored


def test_accepted_jobs_are_all_answered_once_after_the_master_is_killed(
        failover_stack: FailoverStack, sentinel_group: SentinelGroup) -> None:
    stack = failover_stack
    stack.script(delay=ENGINE_DELAY)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(stack.submit, range(JOBS)))
    assert [r.status_code for r in responses] == [202] * JOBS, [r.text for r in responses if r.status_code != 202]
    job_ids = [r.json()["id"] for r in responses]
    replica = sentinel_group.client(sentinel_group.replica_port)
    deadline = time.monotonic() + 30
    while not web.get(f"{stack.engine.url}/stats", timeout=5).json()["live"]:
        assert time.monotonic() < deadline, "no job reached the engine"
        time.sleep(0.05)
    assert all(replica.exists(keys.job_key(job_id)) for job_id in job_ids)

    os.kill(sentinel_group.master.pid, signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    sentinel_group.master.wait(10)
    probes = 0
    refusals: Counter[str] = Counter()  # each 503's message: what stood in the way, for a failure's report
    while True:  # a new request, sent again on each 503, until it is accepted
        response = stack.submit(JOBS + probes)
        probes += 1
        if response.status_code == 202:
            break
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        refusals[response.json()["detail"]["message"]] += 1
        assert time.monotonic() - killed_at < 40, (
            f"no new request accepted 40 s after the master's kill; 503s: {dict(refusals)}\n"
            f"{sentinel_group.events()}\nworker's log:\n{stack.worker.output()[-3000:]}")
        time.sleep(0.1)
    answered_after = time.monotonic() - killed_at
    switched_at = sentinel_group.switched_at()
    assert switched_at is not None, sentinel_group.events()
    promoted_after = switched_at - killed_wall
    job_ids.append(response.json()["id"])
    stack.script(delay=0.05)

    assert final_statuses(stack.url, job_ids) == ["succeeded"] * (JOBS + 1)
    assert sentinel_group.current_master() == sentinel_group.replica_port
    assert stack.worker.alive() and stack.api.alive()  # followed the new master: nothing was restarted
    stored = stored_outcomes(stack.worker)
    assert {job_id: stored[job_id] for job_id in job_ids} == dict.fromkeys(job_ids, 1)  # none stored twice
    print(f"\nfailover: a new request accepted {answered_after:.2f} s after the master's kill -9, the Sentinels' "
          f"promotion after {promoted_after:.2f} s ({probes} tries; 503s: {dict(refusals)}); {JOBS}/{JOBS} accepted "
          "jobs succeeded")
    # Issue 32's target when the Sentinels' first election finishes (about 2.3 s to the promotion); after one that
    # stalled, openjev still follows the promotion within FOLLOWS_WITHIN.
    assert answered_after < max(ANSWERED_WITHIN, promoted_after + FOLLOWS_WITHIN), (
        f"accepted after {answered_after:.2f} s, the promotion after {promoted_after:.2f} s\n{sentinel_group.events()}")


def test_sentinels_are_host_port_pairs_separated_by_commas() -> None:
    settings = Settings(_env_file=None, redis_sentinels="a.example:26379, b.example:26380")  # type: ignore[call-arg]
    assert settings.redis_sentinels == [("a.example", 26379), ("b.example", 26380)]
    with pytest.raises(ValueError, match="host:port"):
        Settings(_env_file=None, redis_sentinels="a.example")  # type: ignore[call-arg]


def test_a_password_in_the_url_wins_over_openjev_redis_password() -> None:
    def password(**settings: str) -> str | None:
        client = redis_connection(Settings(_env_file=None, **settings))  # type: ignore[call-arg]
        return client.connection_pool.connection_kwargs.get("password")

    assert password(redis_url="redis://:in-url@h:6379/0", redis_password="apart") == "in-url"
    assert password(redis_url="redis://h:6379/0", redis_password="apart") == "apart"
    assert password(redis_url="redis://h:6379/0", redis_password="apart", redis_sentinels="s:26379") == "apart"
    assert password(redis_url="redis://h:6379/0") is None


def test_a_full_redis_that_fails_over_refuses_out_loud_and_loses_no_accepted_job(
        failover_stack: FailoverStack, sentinel_group: SentinelGroup) -> None:
    """Master and replica at their maxmemory (noeviction) when the master is killed: each submission is
    accepted or refused 503 with Retry-After (full, or unreachable while the Sentinels promote the replica),
    once the new master's limit is lifted the next is accepted, and every accepted job is answered once.
    The API's warnings keep their pace while the full Redis takes some placements and refuses others."""
    stack = failover_stack
    stack.script(delay=0.5)  # the worker's four slots stay busy: jobs pile up in the queue

    def request(i: int) -> dict[str, Any]:
        return body({"q": NOUL}, state=f"Ticket {i}: refund? " + "The order arrived damaged. " * 60)

    def submit(i: int) -> httpx.Response:
        return web.post(stack.url + "/v1/jobs", json=request(i), timeout=30)

    def accepted_or_refused_out_loud(response: httpx.Response) -> str:
        if response.status_code == 202:
            return "accepted"
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["detail"]["error_type"] == "unavailable_error"
        return response.json()["detail"]["message"].split(" (")[0].split(";")[0]

    master = sentinel_group.client(sentinel_group.master_port)
    replica = sentinel_group.client(sentinel_group.replica_port)
    for server in (master, replica):
        server.config_set("maxmemory", master.info("memory")["used_memory"] + 300_000)
    job_ids: list[str] = []
    first_full = None
    for i in range(2000):
        response = submit(i)
        if response.status_code != 202:
            first_full = accepted_or_refused_out_loud(response)
            break
        job_ids.append(response.json()["id"])
    assert first_full == "the job queue is full", first_full
    full_at = time.monotonic()

    os.kill(sentinel_group.master.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    sentinel_group.master.wait(10)
    seen: Counter[str] = Counter()
    while time.monotonic() - killed_at < 10.0 or sentinel_group.current_master() != sentinel_group.replica_port:
        assert time.monotonic() - killed_at < 30, f"no promotion within 30 s: {sentinel_group.events()}"
        response = submit(len(job_ids) + sum(seen.values()))
        seen[accepted_or_refused_out_loud(response)] += 1
        if response.status_code == 202:
            job_ids.append(response.json()["id"])
        time.sleep(0.1)
    assert seen["the job queue is full"] > 0, seen  # the promoted replica holds the same jobs, and its limit
    refused_for = time.monotonic() - full_at

    replica.config_set("maxmemory", 0)  # the operator lifts the new master's limit
    response = answered(stack.url, request(len(job_ids) + sum(seen.values())), timeout=20, path="/v1/jobs")
    assert response.status_code == 202, response.text
    job_ids.append(response.json()["id"])
    stack.script(delay=0.02)
    assert final_statuses(stack.url, job_ids) == ["succeeded"] * len(job_ids)
    stored = stored_outcomes(stack.worker)
    assert {job_id: stored[job_id] for job_id in job_ids} == dict.fromkeys(job_ids, 1)  # none stored twice
    assert stack.worker.alive() and stack.api.alive()
    warned = [e["message"] for e in events(stack.api.output())
              if e.get("level") == "warning" and e["message"].startswith("the job queue's Redis failed")]
    assert 1 <= len(warned) <= 2 + refused_for // 10, (refused_for, seen, warned)
    print(f"\nfull through a failover: {len(job_ids)} accepted jobs succeeded; submissions after the kill: "
          f"{dict(seen)}; {len(warned)} warnings in the API's log over {refused_for:.1f} s")
