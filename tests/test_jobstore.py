"""The job status record (common/jobstore.py) as recovery moves jobs between queues."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest_asyncio
from redis.asyncio import Redis

from common.jobs import JobOutcome, JobStatus
from common.jobstore import JobStore


@pytest_asyncio.fixture(loop_scope="function")
async def store(redis_server: str) -> AsyncIterator[JobStore]:
    client = Redis.from_url(redis_server)
    yield JobStore(client, result_ttl=60)
    await client.aclose()


async def create(store: JobStore, job_id: str, now: float) -> None:
    """A queued job on the dead worker's queue, as the API records it."""
    async with store.redis.pipeline(transaction=True) as pipe:
        store.stage_create(pipe, job_id, "req_test", now, now + 60, "openjev:queue:dead")
        await pipe.execute()


async def test_a_job_moved_off_a_vanished_worker_is_queued_on_its_new_queue(store: JobStore) -> None:
    now = time.time()
    await create(store, "job_moved", now)
    await store.start("job_moved", "dead")
    assert await store.requeue("job_moved", "openjev:queue:alive")
    record = await store.get("job_moved")
    assert record is not None and (record.status, record.queue) == (JobStatus.queued, "openjev:queue:alive")


async def test_a_job_that_ended_before_its_worker_vanished_is_never_revived_by_a_move(store: JobStore) -> None:
    now = time.time()
    await create(store, "job_done", now)
    await store.start("job_done", "dead")
    await store.finish("job_done", JobOutcome(status=JobStatus.succeeded, result={"answers": {}}, worker_id="dead"))
    assert not await store.requeue("job_done", "openjev:queue:alive")
    record = await store.get("job_done")
    assert record is not None and (record.status, record.queue) == (JobStatus.succeeded, "openjev:queue:dead")
    assert not await store.start("job_done", "alive")  # so the worker it was moved to skips it
