"""The API's side of the queue: route a job to a worker and enqueue it (one script, api/dispatch.py),
and learn of its completion by a pushed notice (one pub/sub subscription per process), with the job
record as the truth."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator

import orjson
from arq.connections import ArqRedis
from arq.constants import abort_jobs_ss, job_key_prefix
from arq.jobs import serialize_job
from redis.exceptions import RedisError

from api.dispatch import Dispatcher
from api.errors import NoWorker, Overloaded, QueueUnavailable
from common import keys
from common.jobs import EvaluationJob, JobOutcome, JobStatus, serialize
from common.jobstore import JobRecord, JobStore
from common.membership import WorkerInfo, fleet
from common.settings import RoutingPolicy

log = logging.getLogger("openjev.api")

RECHECK_INTERVAL = 1.0  # seconds between record checks, in case a completion notice was missed


class CompletionWaiter:
    """Resolves waiting requests when a worker publishes "<job id> <outcome JSON>" on the done channel."""

    def __init__(self, redis: ArqRedis) -> None:
        self.redis = redis
        self._waiting: dict[str, set[asyncio.Future[bytes]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def expect(self, job_id: str) -> asyncio.Future[bytes]:
        """A future set to the outcome JSON when `job_id`'s end is announced; call `forget` when done."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, set()).add(future)
        return future

    def forget(self, job_id: str, future: asyncio.Future[bytes]) -> None:
        futures = self._waiting.get(job_id)
        if futures is not None:
            futures.discard(future)
            if not futures:
                del self._waiting[job_id]

    async def _listen(self) -> None:
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(keys.DONE_CHANNEL)
                    async for message in pubsub.listen():
                        self._announce(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: resubscribe; waiters recheck records meanwhile
                log.warning("completion subscription lost (%r); resubscribing", exc)
                await asyncio.sleep(0.5)

    def _announce(self, notice: bytes) -> None:
        job_id, _, outcome = notice.partition(b" ")
        for future in self._waiting.pop(job_id.decode(), ()):
            if not future.done():
                future.set_result(outcome)


class JobQueue:
    """Submits evaluation jobs to the routed worker's queue and waits for their outcome."""

    def __init__(self, redis: ArqRedis, store: JobStore, waiter: CompletionWaiter, load_factor: float = 1.25,
                 routing: RoutingPolicy = RoutingPolicy.hash) -> None:
        """`load_factor`: c of the bounded-load fallback; `routing`: hash (production) or round_robin."""
        self.redis = redis
        self.store = store
        self.waiter = waiter
        self.dispatcher = Dispatcher(redis, load_factor, routing)

    async def fleet(self) -> list[tuple[WorkerInfo, int]]:
        """Every heartbeating worker (engine up or down) with its queue length; one round trip."""
        with _reachable():
            return await fleet(self.redis)

    async def submit(self, job: EvaluationJob) -> str:
        """Route and enqueue `job` in one step (api/dispatch.py); returns the queue it went to.
        The job is arq's, as `enqueue_job` writes it, without its WATCH/EXISTS guard (which only
        protects caller-chosen ids; ours are fresh and random)."""
        now_ms = int(time.time() * 1000)
        # The job is already JSON-shaped: pydantic-core writes it, orjson embeds it as is.
        payload = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(job.model_dump_json()),), {}, None, now_ms,
                                serializer=serialize)
        fields, ttl = self.store.new_record(job.request_id, job.created_at, job.deadline_at)
        remaining = job.remaining()
        with _reachable():
            placed = await self.dispatcher.place(job.id, job.prefix_hash, remaining, keys.job_key(job.id), fields,
                                                 ttl, job_key_prefix + job.id, payload)
        if placed.queue is not None:
            return placed.queue
        if placed.no_worker:
            raise NoWorker("no worker is live yet (starting up, or all engines down); retry shortly",
                           {"Retry-After": "5"})
        soonest = placed.soonest or 0.0
        retry = max(1, math.ceil(soonest - remaining))
        raise Overloaded(f"every worker's queue would finish this request after its deadline "
                         f"({remaining:.0f} s); retry in {retry} s", {"Retry-After": str(retry)})

    async def run(self, job: EvaluationJob, timeout: float) -> JobOutcome | None:
        """Submit `job` and wait for its outcome; None if `timeout` seconds pass first. The notice
        is expected before the job is enqueued, so nothing needs reading back on the way."""
        future = self.waiter.expect(job.id)
        try:
            await self.submit(job)
            return await self._outcome(job.id, future, time.monotonic() + timeout, read_first=False)
        finally:
            self.waiter.forget(job.id, future)

    async def wait(self, job_id: str, timeout: float) -> JobOutcome | None:
        """The outcome of a job submitted earlier, once it ends; None if `timeout` seconds pass
        first (or the job is unknown)."""
        future = self.waiter.expect(job_id)
        try:
            return await self._outcome(job_id, future, time.monotonic() + timeout, read_first=True)
        finally:
            self.waiter.forget(job_id, future)

    async def _outcome(self, job_id: str, future: asyncio.Future[bytes], deadline: float,
                       read_first: bool) -> JobOutcome | None:
        """The pushed notice answers at once; the record is read now and then in case a notice was
        missed (and first, unless the job was only just submitted)."""
        read = read_first
        while True:
            if read:
                record = await self._read(job_id)
                if record is None:
                    return None
                if record.status.terminal:
                    return record.outcome
            read = True
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                notice = await asyncio.wait_for(asyncio.shield(future), min(left, RECHECK_INTERVAL))
                return JobOutcome.model_validate_json(notice)

    async def _read(self, job_id: str) -> JobRecord | None:
        with _reachable():
            return await self.store.get(job_id)

    async def cancel(self, job_id: str, status: JobStatus, error_type: str, message: str, http_status: int) -> bool:
        """End the job as `status` unless it already ended, and have its worker abort it."""
        outcome = JobOutcome(status=status, error={"error_type": error_type, "message": message},
                             http_status=http_status)
        with _reachable():
            won = await self.store.finish(job_id, outcome)
            record = await self.store.get(job_id)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zadd(abort_jobs_ss, {job_id: int(time.time() * 1000)})
                if record is not None and record.queue:
                    pipe.lpush(keys.wake_key(record.queue), keys.WAKE_ALL)
                await pipe.execute()
        return won


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Redis errors inside become QueueUnavailable: a 503 with Retry-After."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise QueueUnavailable() from exc
