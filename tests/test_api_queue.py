"""The API's wait for a sync job (api/queue_client.py `JobQueue.run`) over a real Redis: the outcome comes
from the completion notice, without reading the record back, and the record is dropped after; a
request whose notice never arrives still gets its outcome from the record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest_asyncio
from arq.connections import ArqRedis, RedisSettings, create_pool

from api.queue_client import CompletionWaiter, JobQueue
from common.jobs import JobOutcome, JobSpec, JobStatus, deserialize, serialize
from common.queue import keys
from common.queue.membership import WorkerInfo, heartbeat
from common.queue.records import SYNC_ANSWERED_KEEP, JobStore
from common.settings import ConfidenceMode
from tests.conftest import claim_and_start

OUTCOME = JobOutcome(status=JobStatus.succeeded, result={"answers": {"q": {"p": 0.25}}})


@pytest_asyncio.fixture(loop_scope="function")
async def arq_redis(redis_server: str) -> AsyncIterator[ArqRedis]:
    pool = await create_pool(RedisSettings.from_dsn(redis_server), job_serializer=serialize,
                             job_deserializer=deserialize)
    await pool.flushdb()
    await heartbeat(pool, WorkerInfo(id="w1", queue=keys.queue_name("w1"), model="m", max_jobs=4, max_branches=8,
                                     started_at=time.time()))
    yield pool
    await pool.aclose()


class CountingStore(JobStore):
    """A JobStore that counts reads of the record back (to tell the notice's answer from the record's)."""

    collected = 0

    async def collect(self, job_id: str) -> tuple[JobStatus | None, JobOutcome | None]:
        self.collected += 1
        return await super().collect(job_id)


def job(job_id: str) -> JobSpec:
    now = time.time()
    return JobSpec(id=job_id, request_id="req_" + job_id, model="m", prefix_ids=[1, 2, 3], prefix_hash="k",
                         branches=[], created_at=now, deadline_at=now + 30, temperature=1.0,
                         confidence=ConfidenceMode.typesafe)


async def finish(store: JobStore, job_id: str) -> None:
    """What the worker does: wait for the placement, start it, store the outcome."""
    record_key = keys.job_key(job_id)
    while (placement := await store.redis.hget(record_key, "placement")) is None:
        await asyncio.sleep(0.01)
    assert await claim_and_start(store.redis, placement.decode(), "w1") is not None
    assert await store.store(placement.decode(), OUTCOME, time.monotonic() + 5)


async def test_a_sync_answer_comes_from_the_notice_and_its_record_only_expires(arq_redis: ArqRedis) -> None:
    """No command after the answer (issue 29: a DEL per request was 9% of the API's CPU): the record
    stays, for a waiter that missed the notice, and expires SYNC_ANSWERED_KEEP s later."""
    store = CountingStore(arq_redis, result_ttl=600)
    waiter = CompletionWaiter(arq_redis)
    await waiter.start()
    try:
        queue = JobQueue(arq_redis, store, waiter)
        outcome, _ = await asyncio.gather(queue.run(job("job_a"), 10), finish(store, "job_a"))
        assert outcome == OUTCOME
        assert store.collected == 0  # answered from the notice
        assert 0 < await arq_redis.ttl(keys.job_key("job_a")) <= SYNC_ANSWERED_KEEP
    finally:
        await waiter.stop()


async def test_a_missed_notice_is_made_up_by_the_record(arq_redis: ArqRedis) -> None:
    store = CountingStore(arq_redis, result_ttl=600)
    waiter = CompletionWaiter(arq_redis)  # never started: no notice reaches it
    queue = JobQueue(arq_redis, store, waiter)
    started = time.monotonic()
    outcome, _ = await asyncio.gather(queue.run(job("job_m"), 10), finish(store, "job_m"))
    assert outcome == OUTCOME
    assert store.collected >= 1 and time.monotonic() - started < 3  # the record, at the next recheck
    assert not await arq_redis.exists(keys.job_key("job_m"))  # collected: removed


async def test_a_sync_job_ended_for_its_apis_lapsed_presence_is_answered_with_its_503_outcome(
        arq_redis: ArqRedis) -> None:
    """A live API whose presence lapsed (cut off from Redis for longer than it lasts, common/queue/presence.py)
    is not left waiting on a job no worker will run: the worker's claim ends it, and the waiting request gets
    the 503 outcome from the notice."""
    from common.queue.claims import Claims

    store = CountingStore(arq_redis, result_ttl=600)
    waiter = CompletionWaiter(arq_redis)
    await waiter.start()
    try:
        queue = JobQueue(arq_redis, store, waiter, api_id="api-lapsed")  # its key is never set

        async def claim_once_placed() -> None:
            record_key = keys.job_key("job_l")
            while (placement := await arq_redis.hget(record_key, "placement")) is None:
                await asyncio.sleep(0.01)
            assert await arq_redis.hget(record_key, "api") == b"api-lapsed"
            claimed = await Claims(arq_redis, keys.queue_name("w1"), "w1", 60.0, unseen_before=0.0).claim(
                placement.decode())
            assert claimed is not None and claimed.gone

        outcome, _ = await asyncio.gather(queue.run(job("job_l"), 10), claim_once_placed())
        assert outcome is not None and outcome.status is JobStatus.cancelled and outcome.http_status == 503
        assert outcome.error is not None and outcome.error["error_type"] == "unavailable_error"
        assert store.collected == 0  # from the notice
    finally:
        await waiter.stop()
