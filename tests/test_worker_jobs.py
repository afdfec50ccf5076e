"""The worker's own job path (worker/runner.py: arq's stock Worker running `evaluate`) on a real
worker process: jobs found by its look at the queue, unreadable jobs, jobs interrupted too often, and stale
placements. The job is written into Redis in arq's layout under its placement, as the API writes it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from arq.jobs import serialize_job
from redis import Redis

from api.preparation import JobPreparer
from common.contract import EXAMPLE_REQUEST, SystemOneRequest
from common.jobs import JobSpec, JobStatus, serialize
from common.prompt import PromptCompiler
from common.queue import keys
from common.settings import Settings
from harness.stacks import Stack, isolated_scripted_stack

QUEUE = keys.queue_name("w0")  # the stack's worker


@pytest.fixture(scope="module")
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir) as running:
        yield running


@pytest.fixture(scope="module")
def redis(stack: Stack) -> Iterator[Redis]:
    client = Redis.from_url(stack.redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def preparer(smollm2_compiler: PromptCompiler) -> JobPreparer:
    return JobPreparer(Settings(), smollm2_compiler)


def new_job(preparer: JobPreparer) -> JobSpec:
    return preparer.prepare(SystemOneRequest.model_validate(EXAMPLE_REQUEST), "req_worker_test", 30)


def put(redis: Redis, job: JobSpec, payload: bytes | None = None, placement: int = 1) -> str:
    """Record and enqueue `job` on the worker's queue as the API does (or with another payload); the
    record names `placement`, the queue holds placement 1. Returns the queued arq job id."""
    if payload is None:
        payload = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(job.model_dump_json()),), {}, None,
                                int(time.time() * 1000), serializer=serialize)
    arq_job_id = keys.placement_id(job.id, 1)
    redis.hset(keys.job_key(job.id), mapping={
        "status": "queued", "request_id": job.request_id, "created_at": repr(time.time()),
        "deadline_at": repr(time.time() + 30), "queue": QUEUE, "placement": keys.placement_id(job.id, placement)})
    redis.set(keys.ARQ_JOB + arq_job_id, payload, ex=120)
    redis.zadd(QUEUE, {arq_job_id: int(time.time() * 1000)})
    return arq_job_id


def ended(redis: Redis, job_id: str, timeout: float = 10.0) -> dict[str, object]:
    """The job's outcome once its record is terminal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = redis.hgetall(keys.job_key(job_id))
        if record.get(b"status") not in (None, b"queued", b"running"):
            return {"status": record[b"status"].decode(), **orjson.loads(record[b"outcome"])}
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end within {timeout} s")


def assert_dequeued(redis: Redis, arq_job_id: str, timeout: float = 5.0) -> None:
    """arq removed the placement from its queue with all its keys (after the outcome was stored)."""
    deadline = time.monotonic() + timeout
    while redis.zscore(QUEUE, arq_job_id) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis.zscore(QUEUE, arq_job_id) is None
    assert not redis.exists(keys.ARQ_IN_PROGRESS + arq_job_id, keys.ARQ_RETRY + arq_job_id, keys.ARQ_JOB + arq_job_id)


def test_a_queued_placement_found_by_a_look_at_the_queue_runs_and_leaves_no_arq_keys(
        redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    arq_job_id = put(redis, job)
    outcome = ended(redis, job.id, timeout=5.0)
    assert outcome["status"] == JobStatus.succeeded and outcome["result"]["answers"].keys() == {
        "refund", "department", "urgency"}
    assert_dequeued(redis, arq_job_id)


def test_an_unreadable_job_ends_failed_and_leaves_the_queue(redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    arq_job_id = put(redis, job, payload=b'{"t": 1, "f": "evaluate", "a": [{"version": 99}], "k": {}, "et": 0}')
    outcome = ended(redis, job.id)
    assert (outcome["status"], outcome["http_status"], outcome["error"]["error_type"]) == ("failed", 500, "api_error")
    assert_dequeued(redis, arq_job_id)


def test_a_job_interrupted_too_often_is_not_run_again(stack: Stack, redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    received = stack.engine_stats()["requests_received"]
    redis.set(keys.ARQ_RETRY + keys.placement_id(job.id, 1), 3)  # three earlier workers died holding it
    arq_job_id = put(redis, job)
    outcome = ended(redis, job.id)
    assert (outcome["status"], outcome["http_status"]) == ("failed", 500)
    assert "interrupted 3 times" in outcome["error"]["message"]
    assert stack.engine_stats()["requests_received"] == received  # the engine never saw it
    assert_dequeued(redis, arq_job_id)


def test_a_placement_that_is_no_longer_its_jobs_is_dropped_unrun(stack: Stack, redis: Redis,
                                                                 preparer: JobPreparer) -> None:
    job = new_job(preparer)
    received = stack.engine_stats()["requests_received"]
    arq_job_id = put(redis, job, placement=2)  # the job moved on; placement 1 is a stale copy
    assert_dequeued(redis, arq_job_id)
    assert redis.hget(keys.job_key(job.id), "status") == b"queued"  # neither started nor ended by it
    assert stack.engine_stats()["requests_received"] == received
