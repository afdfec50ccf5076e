"""The worker's own job path (worker/runner.py) on a real worker process: jobs found without a
wake-up, unreadable jobs, jobs interrupted too often, and stray wake-ups. The job is written into
Redis in arq's layout, as the API writes it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.jobs import serialize_job
from redis import Redis

from api.preparation import JobPreparer
from common.contract import EXAMPLE_REQUEST, SystemOneRequest
from common.jobs import EvaluationJob, JobStatus, serialize
from common.prompt import PromptCompiler
from common.queue import keys
from common.settings import Settings
from tests.conftest import Stack, isolated_scripted_stack

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


def new_job(preparer: JobPreparer) -> EvaluationJob:
    return preparer.prepare(SystemOneRequest.model_validate(EXAMPLE_REQUEST), "req_worker_test", 30)


def put(redis: Redis, job: EvaluationJob, payload: bytes | None = None, wake: bool = True) -> None:
    """Record and enqueue `job` on the worker's queue as the API does (or with another payload)."""
    if payload is None:
        payload = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(job.model_dump_json()),), {}, None,
                                int(time.time() * 1000), serializer=serialize)
    redis.hset(keys.job_key(job.id), mapping={"status": "queued", "request_id": job.request_id,
                                              "created_at": repr(job.created_at),
                                              "deadline_at": repr(job.deadline_at), "queue": QUEUE})
    redis.set(job_key_prefix + job.id, payload, ex=120)
    redis.zadd(QUEUE, {job.id: int(time.time() * 1000)})
    if wake:
        redis.rpush(keys.wake_key(QUEUE), job.id)


def ended(redis: Redis, job_id: str, timeout: float = 10.0) -> dict[str, object]:
    """The job's outcome once its record is terminal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = redis.hgetall(keys.job_key(job_id))
        if record.get(b"status") not in (None, b"queued", b"running"):
            return {"status": record[b"status"].decode(), **orjson.loads(record[b"outcome"])}
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end within {timeout} s")


def assert_dequeued(redis: Redis, job_id: str) -> None:
    assert redis.zscore(QUEUE, job_id) is None
    assert not redis.exists(in_progress_key_prefix + job_id, retry_key_prefix + job_id, job_key_prefix + job_id)


def test_a_job_whose_wake_up_was_lost_is_found_by_the_poll(redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    put(redis, job, wake=False)
    outcome = ended(redis, job.id, timeout=5.0)  # the worker polls its whole queue every 0.5 s
    assert outcome["status"] == JobStatus.succeeded and outcome["result"]["answers"].keys() == {
        "refund", "department", "urgency"}
    assert_dequeued(redis, job.id)


def test_an_unreadable_job_ends_failed_and_leaves_the_queue(redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    put(redis, job, payload=b'{"t": 1, "f": "evaluate", "a": [{"version": 99}], "k": {}, "et": 0}')
    outcome = ended(redis, job.id)
    assert (outcome["status"], outcome["http_status"], outcome["error"]["error_type"]) == ("failed", 500, "api_error")
    assert_dequeued(redis, job.id)


def test_a_job_interrupted_too_often_is_not_run_again(stack: Stack, redis: Redis, preparer: JobPreparer) -> None:
    job = new_job(preparer)
    received = stack.engine_stats()["requests_received"]
    redis.set(retry_key_prefix + job.id, 3)  # three earlier workers died holding it (arq's max_tries)
    put(redis, job)
    outcome = ended(redis, job.id)
    assert (outcome["status"], outcome["http_status"]) == ("failed", 500)
    assert "interrupted 3 times" in outcome["error"]["message"]
    assert stack.engine_stats()["requests_received"] == received  # the engine never saw it
    assert_dequeued(redis, job.id)


def test_a_stray_wake_up_changes_nothing_and_the_next_job_runs(redis: Redis, preparer: JobPreparer) -> None:
    redis.rpush(keys.wake_key(QUEUE), "job_that_is_not_queued_here")
    job = new_job(preparer)
    put(redis, job)
    assert ended(redis, job.id)["status"] == JobStatus.succeeded
    assert not redis.exists(keys.job_key("job_that_is_not_queued_here"))
