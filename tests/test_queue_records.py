"""The job record's scripts (common/queue/records.py) and moves (common/queue/leases.py): only a
job's current placement starts it or stores its outcome, once; the API's endings leave bounded
abort marks; sync records go at delivery; a lapsed worker's jobs move as new placements."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common.jobs import JobOutcome, JobStatus
from common.queue import keys
from common.queue.leases import Lease, LeaseLapsed, LeaseTaken, beat, reap_vanished_workers
from common.queue.membership import LIVENESS_WINDOW, WorkerInfo, heartbeat
from common.queue.placement import Dispatcher
from common.queue.records import NOTICE_OUTCOME_MAX, SYNC_ANSWERED_KEEP, SYNC_KEEP, JobStore
from common.redis_connection import out_of_memory
from common.settings import RoutingPolicy
from tests.conftest import claim_and_start, redis_now

DONE = JobOutcome(status=JobStatus.succeeded, result={"answers": {}})
CANCELLED = JobOutcome(status=JobStatus.cancelled, http_status=499)


@pytest_asyncio.fixture(loop_scope="function")
async def store(redis: Redis) -> JobStore:
    return JobStore(redis, result_ttl=600, abort_mark_ttl=120)


async def join(redis: Redis, worker_id: str) -> WorkerInfo:
    info = WorkerInfo(id=worker_id, queue=keys.queue_name(worker_id), model="m", max_jobs=4, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    return info


async def submit(redis: Redis, job_id: str, kind: str = "async", seconds: float = 60.0) -> str:
    placed = await Dispatcher(redis, 1.25, RoutingPolicy.hash).place(
        job_id, "k", seconds, {"status": "queued", "request_id": "req_t", "kind": kind}, 600, b"payload")
    assert placed.queue is not None
    return placed.queue


async def test_only_the_current_placement_starts_and_stores_once_and_announces_id_and_status(
        redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    queue = await submit(redis, "job_a")
    await redis.zadd(queue, {"job_a.2": 0})  # a placement in the queue that the record does not name
    assert await claim_and_start(redis, "job_a.2", "w1") is None  # claimed for arq to finish, never started
    started = await claim_and_start(redis, "job_a.1", "w1")
    assert started is not None and 59 < started.remaining <= 60 and 0 <= started.waited < 1
    record = await store.get("job_a")
    assert record is not None and record.status == JobStatus.running
    assert await redis.hget(keys.job_key("job_a"), "worker") == b"w1"
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(keys.DONE_CHANNEL)
        await pubsub.get_message(timeout=1)
        assert await store.store("job_a.2", DONE, time.monotonic() + 5) is False
        assert await store.store("job_a.1", DONE, time.monotonic() + 5) is True
        failed = JobOutcome(status=JobStatus.failed, http_status=502)
        assert await store.store("job_a.1", failed, time.monotonic() + 5) is True  # a retry finds its own store
        notice = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5) is None  # announced once
    assert notice is not None and notice["data"] == b"job_a succeeded"  # id and status, not the result
    record = await store.get("job_a")
    assert record is not None and record.status is JobStatus.succeeded  # stored once
    await redis.delete(keys.ARQ_IN_PROGRESS + "job_a.1")  # its claim lapsed with the placement still queued
    assert await claim_and_start(redis, "job_a.1", "w1") is None  # ended: never run again
    assert 590 <= await redis.ttl(keys.job_key("job_a")) <= 600


async def test_a_store_a_full_redis_refuses_is_tried_until_its_time_with_one_warning_then_lands(
        redis: Redis, store: JobStore, caplog: pytest.LogCaptureFixture) -> None:
    await join(redis, "w1")
    for job_id in ("job_full", "job_full_too"):
        await submit(redis, job_id)
        assert await claim_and_start(redis, f"{job_id}.1", "w1") is not None
    await redis.config_set("maxmemory", 1)  # this module's own Redis: every write that needs memory is refused
    try:
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="openjev.queue"):
            refused = await asyncio.gather(store.store("job_full.1", DONE, started + 1.5),
                                           store.store("job_full_too.1", DONE, started + 1.5), return_exceptions=True)
        assert all(isinstance(error, ResponseError) and out_of_memory(error) for error in refused), refused
        assert time.monotonic() - started >= 1.5  # tried until its time: six tries each
        warned = [r.getMessage() for r in caplog.records if "storing a job's outcome failed" in r.getMessage()]
        assert len(warned) == 1, warned  # not one a try, nor one a job
        # ... and that one at the first try: the first failure's form, with no count of failures since
        assert warned[0].startswith("storing a job's outcome failed (") and "more failures" not in warned[0]
        assert warned[0].endswith(" tries again every 0.25 s until its deadline"), warned
        assert "job job_full" in warned[0]  # which job it was
    finally:
        await redis.config_set("maxmemory", 0)
    with caplog.at_level(logging.INFO, logger="openjev.queue"):
        assert await store.store("job_full.1", DONE, time.monotonic() + 5) is True
    back = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert len(back) == 1 and back[0].startswith("storing a job's outcome works again after "), caplog.text
    assert int(back[0].split(" after ")[1].split()[0]) >= 8, back  # both jobs' tries: about six each
    record = await store.get("job_full")
    assert record is not None and record.status is JobStatus.succeeded


async def test_ending_a_finished_job_leaves_no_abort_mark_and_old_marks_are_trimmed(
        redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    await submit(redis, "job_done")
    await claim_and_start(redis, "job_done.1", "w1")
    await store.store("job_done.1", DONE, time.monotonic() + 5)
    for _ in range(50):
        assert await store.cancel("job_done", CANCELLED) is False
    assert await redis.zcard(keys.ARQ_ABORTS) == 0
    await redis.zadd(keys.ARQ_ABORTS, {"job_ancient.1": int((time.time() - 3 * 3600) * 1000)})
    await submit(redis, "job_queued")
    assert await store.cancel("job_queued", CANCELLED) is True  # not started: taken off its queue, no mark
    assert not await redis.zscore(keys.queue_name("w1"), "job_queued.1")
    assert not await redis.exists(keys.ARQ_JOB + "job_queued.1")
    await submit(redis, "job_live")
    await claim_and_start(redis, "job_live.1", "w1")
    assert await store.cancel("job_live", CANCELLED) is True
    assert await redis.zrange(keys.ARQ_ABORTS, 0, -1) == [b"job_live.1"]  # the ancient mark is gone
    for job_id in ("job_queued", "job_live"):
        record = await store.get(job_id)
        assert record is not None and record.status is JobStatus.cancelled


async def test_a_sync_job_is_removed_when_collected_or_cancelled(redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    await submit(redis, "job_s", kind="sync")
    assert await store.collect("job_s") == (JobStatus.queued, None)
    await claim_and_start(redis, "job_s.1", "w1")
    await store.store("job_s.1", DONE, time.monotonic() + 5)
    assert await redis.ttl(keys.job_key("job_s")) <= SYNC_KEEP
    status, outcome = await store.collect("job_s")
    assert status is JobStatus.succeeded and outcome is not None and outcome.result == {"answers": {}}
    assert not await redis.exists(keys.job_key("job_s"))
    await submit(redis, "job_t", kind="sync")
    assert await store.cancel("job_t", CANCELLED) is True
    assert not await redis.exists(keys.job_key("job_t"))
    assert await store.store("job_t.1", DONE, time.monotonic() + 5) is False


async def test_an_overdue_ending_waits_for_the_deadline_by_redis_time(redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    await submit(redis, "job_o", seconds=1.0)
    expired = JobOutcome(status=JobStatus.expired, http_status=504)
    assert await store.cancel("job_o", expired, after_deadline=0.5) is False
    overdue_at = float(await redis.hget(keys.job_key("job_o"), "deadline_at")) + 0.5
    while await redis_now(redis) <= overdue_at:
        await asyncio.sleep(0.05)
    assert await store.cancel("job_o", expired, after_deadline=0.5) is True


async def test_a_lapsed_workers_jobs_move_as_new_placements_and_the_old_one_is_fenced(
        redis: Redis, store: JobStore) -> None:
    await join(redis, "dead")
    await submit(redis, "job_m")
    assert await claim_and_start(redis, "job_m.1", "dead") is not None  # it was running there
    await redis.zadd(keys.WORKERS, {"dead": time.time() - LIVENESS_WINDOW - 1})
    alive = await join(redis, "alive")
    lease = Lease(redis, "dead")
    await lease.acquire()
    assert await reap_vanished_workers(redis) == 0  # leased: its owner resumes its jobs
    await redis.delete(keys.lease_key("dead"))
    assert await reap_vanished_workers(redis) == 1
    assert await redis.zrange(alive.queue, 0, -1) == [b"job_m.2"]
    assert await redis.get(keys.ARQ_JOB + "job_m.2") == b"payload"
    assert not await redis.exists(keys.ARQ_JOB + "job_m.1")
    assert await store.placements(["job_m.1", "job_m.2"]) == [False, True]
    assert await store.store("job_m.1", DONE, time.monotonic() + 5) is False  # the old owner is fenced
    assert await claim_and_start(redis, "job_m.2", "alive") is not None
    assert await store.store("job_m.2", DONE, time.monotonic() + 5) is True


async def test_a_renewal_never_recreates_a_lapsed_lease(redis: Redis) -> None:
    info = await join(redis, "w9")
    lease = Lease(redis, "w9")
    await lease.acquire()
    await redis.delete(keys.lease_key("w9"))
    with pytest.raises(LeaseLapsed):
        await beat(redis, info, lease)
    assert not await redis.exists(keys.lease_key("w9"))
    await redis.set(keys.lease_key("w9"), "someone-else")
    with pytest.raises(LeaseTaken):
        await beat(redis, info, lease)
    assert await redis.get(keys.lease_key("w9")) == b"someone-else"  # another holder's lease is left alone


async def test_a_release_drops_only_its_own_lease(redis: Redis) -> None:
    lease = Lease(redis, "w8")
    await lease.acquire()
    await redis.set(keys.lease_key("w8"), "the-next-holder")  # it lapsed and was taken meanwhile
    await lease.release()
    assert await redis.get(keys.lease_key("w8")) == b"the-next-holder"
    await redis.delete(keys.lease_key("w8"))
    await lease.acquire()
    await lease.release()
    assert not await redis.exists(keys.lease_key("w8"))


async def test_a_beat_heartbeats_renews_and_names_the_silent_members_and_never_recreates_a_lease(
        redis: Redis) -> None:
    info = await join(redis, "w7")
    lease = Lease(redis, "w7")
    await lease.acquire()
    await redis.pexpire(keys.lease_key("w7"), 500)
    await redis.zadd(keys.WORKERS, {"w7": 0.0, "gone": time.time() - LIVENESS_WINDOW - 1})
    info.running = 3
    assert await beat(redis, info, lease) == ["gone"]
    assert await redis.pttl(keys.lease_key("w7")) > 500  # renewed to the full TTL
    assert (await redis.zscore(keys.WORKERS, "w7") or 0) > time.time() - 1  # its heartbeat, by Redis's clock
    assert await redis.hget(keys.route_info_key("w7"), "running") == b"3"
    await redis.delete(keys.lease_key("w7"))
    await redis.zadd(keys.WORKERS, {"w7": 0.0})
    with pytest.raises(LeaseLapsed):
        await beat(redis, info, lease)
    assert not await redis.exists(keys.lease_key("w7"))
    assert (await redis.zscore(keys.WORKERS, "w7") or 0) > time.time() - 1  # the heartbeat went out all the same
    await redis.set(keys.lease_key("w7"), "someone-else")
    with pytest.raises(LeaseTaken):
        await beat(redis, info, lease)


async def test_a_sync_jobs_notice_carries_its_outcome_and_its_record_expires_soon_after(
        redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    await submit(redis, "job_n", kind="sync")
    await claim_and_start(redis, "job_n.1", "w1")
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(keys.DONE_CHANNEL)
        await pubsub.get_message(timeout=1)
        assert await store.store("job_n.1", DONE, time.monotonic() + 5) is True
        notice = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert notice is not None
    job_id, status, outcome = notice["data"].split(b" ", 2)
    assert (job_id, status) == (b"job_n", b"succeeded")
    assert JobOutcome.model_validate_json(outcome) == DONE
    record = await store.get("job_n")  # still the truth for a waiter that missed the notice
    assert record is not None and record.outcome == DONE
    assert 0 < await redis.ttl(keys.job_key("job_n")) <= SYNC_ANSWERED_KEEP  # no DEL per request: it expires


async def test_a_sync_outcome_too_big_for_a_notice_is_announced_bare_and_kept_for_collection(
        redis: Redis, store: JobStore) -> None:
    await join(redis, "w1")
    await submit(redis, "job_b", kind="sync")
    await claim_and_start(redis, "job_b.1", "w1")
    big = JobOutcome(status=JobStatus.succeeded, result={"answers": {"q": "x" * NOTICE_OUTCOME_MAX}})
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(keys.DONE_CHANNEL)
        await pubsub.get_message(timeout=1)
        assert await store.store("job_b.1", big, time.monotonic() + 5) is True
        notice = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert notice is not None and notice["data"] == b"job_b succeeded"
    assert await store.collect("job_b") == (JobStatus.succeeded, big)


def test_the_record_is_written_only_by_this_module_s_lua() -> None:
    """One owner of the job record's writes: the scripts of other modules that create or requeue a job
    (placement's submit, leases' move, reruns' rerun) write its record only through records.py's
    RECORD_LUA functions; their own Lua reads it (HMGET, HGET) and never writes it."""
    from common.queue import leases, placement, reruns
    from common.queue.arq_layout import ARQ_LUA
    from common.queue.records import RECORD_LUA

    for script in (placement._SUBMIT, leases._MOVE, reruns._RERUN):
        assert script.startswith(ARQ_LUA + RECORD_LUA)
        own = script.removeprefix(ARQ_LUA + RECORD_LUA)
        assert "'HSET'" not in own and "'HINCRBY'" not in own and "'HDEL'" not in own, own[:200]
