"""The job status record (common/jobstore.py): a worker taking and ending a job in arq's layout, and
recovery moving jobs between queues."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest_asyncio
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis

from common.jobs import JobOutcome, JobStatus
from common.queue.records import JobStore

QUEUE = "openjev:queue:dead"
ALIVE = "openjev:queue:alive"


@pytest_asyncio.fixture(loop_scope="function")
async def store(redis_server: str) -> AsyncIterator[JobStore]:
    client = Redis.from_url(redis_server)
    yield JobStore(client, result_ttl=60)
    await client.aclose()


async def create(store: JobStore, job_id: str, now: float) -> None:
    """A queued job on the dead worker's queue, as the API records and enqueues it."""
    fields, ttl = store.new_record("req_test", now, now + 60)
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.hset(f"openjev:job:{job_id}", mapping={**fields, "queue": QUEUE})
        pipe.expire(f"openjev:job:{job_id}", ttl)
        pipe.set(job_key_prefix + job_id, b"payload")
        pipe.zadd(QUEUE, {job_id: int(now * 1000)})
        await pipe.execute()


async def test_take_claims_a_queued_job_once_and_marks_it_running(store: JobStore) -> None:
    await create(store, "job_take", time.time())
    taken = await store.take("job_take", QUEUE, "w1", 60_000)
    assert taken is not None and (taken.payload, taken.attempt, taken.runnable) == (b"payload", 1, True)
    assert await store.redis.exists(in_progress_key_prefix + "job_take")
    record = await store.get("job_take")
    assert record is not None and (record.status, record.worker) == (JobStatus.running, "w1")
    assert await store.take("job_take", QUEUE, "w2", 60_000) is None  # held: no second runner
    assert await store.take("job_take", "openjev:queue:other", "w2", 60_000) is None  # not in that queue


async def test_a_job_cancelled_while_queued_is_taken_but_not_runnable(store: JobStore) -> None:
    await create(store, "job_gone", time.time())
    await store.finish("job_gone", JobOutcome(status=JobStatus.cancelled, http_status=499))
    taken = await store.take("job_gone", QUEUE, "w1", 60_000)
    assert taken is not None and not taken.runnable
    record = await store.get("job_gone")
    assert record is not None and record.status is JobStatus.cancelled  # not revived as running


async def test_an_abort_asked_while_queued_makes_the_job_not_runnable(store: JobStore) -> None:
    await create(store, "job_abort", time.time())
    await store.redis.zadd(abort_jobs_ss, {"job_abort": 1})
    taken = await store.take("job_abort", QUEUE, "w1", 60_000)
    assert taken is not None and not taken.runnable
    assert await store.redis.zscore(abort_jobs_ss, "job_abort") is None


async def test_a_worker_finish_stores_announces_and_removes_the_job_in_one_step(store: JobStore) -> None:
    await create(store, "job_end", time.time())
    assert await store.take("job_end", QUEUE, "w1", 60_000)
    async with store.redis.pubsub() as pubsub:
        await pubsub.subscribe("openjev:done")
        assert await store.finish("job_end", JobOutcome(status=JobStatus.succeeded, result={"answers": {}}), QUEUE)
        notice = None
        for _ in range(20):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                notice = message["data"]
                break
    assert notice is not None and notice.startswith(b"job_end {")
    assert await store.redis.zscore(QUEUE, "job_end") is None
    leftovers = [in_progress_key_prefix, retry_key_prefix, job_key_prefix]
    assert not await store.redis.exists(*(prefix + "job_end" for prefix in leftovers))
    # A later write loses and changes nothing.
    assert not await store.finish("job_end", JobOutcome(status=JobStatus.failed, http_status=502), QUEUE)
    record = await store.get("job_end")
    assert record is not None and record.status is JobStatus.succeeded


async def test_a_job_moved_off_a_vanished_worker_is_queued_on_its_new_queue(store: JobStore) -> None:
    now = time.time()
    await create(store, "job_moved", now)
    await store.take("job_moved", QUEUE, "dead", 60_000)
    assert await store.move("job_moved", "dead", ALIVE, 1.0) == 1
    record = await store.get("job_moved")
    # The record already says where the job is when its new worker is woken with its id.
    assert record is not None and (record.status, record.queue) == (JobStatus.queued, ALIVE)
    assert await store.redis.lrange(f"{ALIVE}:wake", 0, -1) == [b"job_moved"]
    assert await store.redis.zscore(QUEUE, "job_moved") is None
    assert await store.redis.zscore(ALIVE, "job_moved") == 1.0
    taken = await store.take("job_moved", ALIVE, "alive", 60_000)  # the dead worker's claim was cleared
    assert taken is not None and taken.runnable
    assert await store.move("job_moved", "dead", ALIVE, 1.0) == 0  # no longer on the dead worker's queue


async def test_a_job_is_not_moved_off_a_worker_whose_id_is_leased_again(store: JobStore) -> None:
    await create(store, "job_resumed", time.time())
    await store.redis.set("openjev:lease:dead", b"restarted", px=5000)
    try:
        assert await store.move("job_resumed", "dead", ALIVE, 1.0) == -1
    finally:
        await store.redis.delete("openjev:lease:dead")
    assert await store.redis.zscore(QUEUE, "job_resumed") is not None
    record = await store.get("job_resumed")
    assert record is not None and record.queue == QUEUE


async def test_a_job_that_ended_before_its_worker_vanished_is_never_revived_by_a_move(store: JobStore) -> None:
    now = time.time()
    await create(store, "job_done", now)
    await store.take("job_done", QUEUE, "dead", 60_000)
    await store.finish("job_done", JobOutcome(status=JobStatus.succeeded, result={"answers": {}}, worker_id="dead"))
    assert await store.move("job_done", "dead", ALIVE, 1.0) == 2
    record = await store.get("job_done")
    assert record is not None and (record.status, record.queue) == (JobStatus.succeeded, QUEUE)
    taken = await store.take("job_done", ALIVE, "alive", 60_000)
    assert taken is not None and not taken.runnable  # so the worker it was moved to skips it
