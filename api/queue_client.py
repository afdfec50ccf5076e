"""The API's side of the queue: place a job (one script, common/queue/placement.py), learn of its
end by a pushed notice ("<job id> <status>", a sync job's with its outcome; one pub/sub subscription
per process) with the job record as the truth, and end jobs the API gives up on. Redis errors become
one 503 here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from arq.connections import ArqRedis
from arq.jobs import serialize_job
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from api.errors import NoWorker, Overloaded, QueueFull, SyncJobLost, TenantLimited, queue_error
from common.background import BackgroundWork
from common.jobs import JobOutcome, JobSpec, JobStatus, Lane, serialize
from common.logs import RepeatedFailure
from common.queue import keys
from common.queue.limits import RateDecision, TenantLimiter, TenantUsage
from common.queue.membership import Backlog, BacklogReader, WorkerInfo, fleet
from common.queue.placement import Admission, Dispatcher, IdempotencyClaim, RedisMemory
from common.queue.records import SYNC_KEEP, JobRecord, JobStore
from common.queue.replication import ReplicaCopy
from common.queue.subscriptions import Subscription
from common.settings import RoutingPolicy
from common.tenants import Tenant

log = logging.getLogger("openjev.api")

RECHECK_INTERVAL = 1.0  # seconds between record checks, in case a completion notice was missed
AOF_WAIT = 5.0  # seconds an async job's 202 waits for its write to reach the append-only file (Redis: 2 s on
# its whole-seconds clock, so at most 3 s)
AOF_POLL = 0.01  # seconds between looks at the file's size meanwhile


class CompletionWaiter:
    """Resolves waiting requests when a job's end is announced on the done channel."""

    def __init__(self, redis: ArqRedis) -> None:
        self.redis = redis
        self._waiting: dict[str, set[asyncio.Future[bytes | None]]] = {}
        self._subscription = Subscription(redis, keys.DONE_CHANNEL, self._announce,
                                          fallback="waiters recheck their records meanwhile", log=log,
                                          retry_delay=0.5, max_retry_delay=RECHECK_INTERVAL)

    async def start(self) -> None:
        await self._subscription.start()

    async def stop(self) -> None:
        await self._subscription.close()

    def expect(self, job_id: str) -> asyncio.Future[bytes | None]:
        """A future resolved when `job_id`'s end is announced, with the outcome JSON where the notice
        carries it (a sync job's store) and None otherwise; call `forget` when done."""
        future: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, set()).add(future)
        return future

    def forget(self, job_id: str, future: asyncio.Future[bytes | None]) -> None:
        futures = self._waiting.get(job_id)
        if futures is not None:
            futures.discard(future)
            if not futures:
                del self._waiting[job_id]

    def _announce(self, notice: bytes) -> None:
        job_id, _, rest = notice.partition(b" ")
        outcome = rest.partition(b" ")[2] or None
        for future in self._waiting.pop(job_id.decode(), ()):
            if not future.done():
                future.set_result(outcome)


@dataclass(frozen=True)
class Submitted:
    """A placed job (`held` None), or the job an idempotency key already names: "<job id>:<digest>"."""

    held: str | None = None


def admission_of(tenant: Tenant, job: JobSpec, lane: Lane, sync: bool, shared_weight: float) -> Admission:
    """How `tenant`'s `job` queues: its limits, its weight, its lane, its cost in engine prompts, and the
    weights of all the tenants sharing the queue (`shared_weight`; 0 where it is this tenant's alone)."""
    return Admission(tenant=tenant.name, lane=lane, sync=sync,
                     prompts=1 + len(job.branches) + len(job.final_rounds), weight=tenant.weight,
                     max_concurrent_jobs=tenant.limits.max_concurrent_jobs,
                     max_queued_jobs=tenant.limits.max_queued_jobs, shared_weight=shared_weight)


class JobQueue:
    """Places evaluation jobs on the routed worker's queue, waits for their outcome, ends them."""

    def __init__(self, redis: ArqRedis, store: JobStore, waiter: CompletionWaiter, load_factor: float = 1.25,
                 routing: RoutingPolicy = RoutingPolicy.hash, headroom: float = 0.0, api_id: str | None = None) -> None:
        """`load_factor`: c of the bounded-load fallback; `routing`: hash (production) or round_robin;
        `headroom`: the share of Redis's maxmemory left to the jobs already placed (no new job past the rest);
        `api_id`: this process's presence in Redis (common/queue/presence.py), named by its sync jobs so that
        no worker starts one once it is gone (None: never checked)."""
        self.redis = redis
        self.api_id = api_id
        self.store = store
        self.waiter = waiter
        self.dispatcher = Dispatcher(redis, load_factor, routing, headroom)
        self._limiter = TenantLimiter(redis)
        self.backlog_reader = BacklogReader(redis, store.longest_job_seconds)
        self.written = AppendOnlyFile(redis)
        self.copied = ReplicaCopy(redis)
        self._reachable = Reachable()
        self._endings = BackgroundWork(log)  # jobs of requests the stopping server cut short, being ended

    async def fleet(self) -> list[tuple[WorkerInfo, int]]:
        """Every heartbeating worker (engine up or down) with its queue length; one round trip."""
        with self._reachable():
            return await fleet(self.redis)

    async def admit(self, tenant: str, per_minute: int, burst: int | None) -> RateDecision:
        """Count one submission of `tenant` against its `per_minute`, up to `burst` at once."""
        with self._reachable():
            return await self._limiter.admit(tenant, per_minute, burst)

    async def usage(self, tenant: str) -> TenantUsage:
        """The tenant's jobs not yet ended and its rate used (GET /v1/limits)."""
        with self._reachable():
            return await self._limiter.usage(tenant)

    async def memory(self, shared: bool) -> RedisMemory | None:
        """Redis's memory and where placements stop (/metrics; `shared`: tenants share the queue); None when its
        ACL refuses INFO."""
        with self._reachable():
            return await self.dispatcher.memory(shared)

    async def backlog(self, workers: list[WorkerInfo]) -> dict[str, Backlog]:
        """Each worker's jobs waiting to start (not the running ones), by worker id; one round trip."""
        with self._reachable():
            waiting = await self.backlog_reader.read([w.queue for w in workers])
        return {w.id: waiting[w.queue] for w in workers}

    async def submit(self, job: JobSpec, admission: Admission = Admission(),
                     idempotency: IdempotencyClaim | None = None) -> Submitted:
        """Place `job` in one step (with its idempotency claim, if any), as `admission` says: for its
        tenant (429 at one of its limits), in its lane. A sync job's record is kept only briefly past its
        deadline: its caller collects it at once; an async one's for the result TTL. The job is arq's, as
        `enqueue_job` writes it, under its placement's arq job id."""
        sync = admission.sync
        now_ms = int(time.time() * 1000)
        # The job is already JSON-shaped: pydantic-core writes it, orjson embeds it as is.
        payload = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(job.model_dump_json()),), {}, None, now_ms,
                                serializer=serialize)
        record = {"status": JobStatus.queued.value, "request_id": job.request_id, "route_key": job.prefix_hash,
                  "kind": "sync" if sync else "async"}
        if sync and self.api_id is not None:
            record["api"] = self.api_id  # its one reader
        remaining = job.remaining()
        with self._reachable():
            placed = await self.dispatcher.place(job.id, job.prefix_hash, remaining, record,
                                                 SYNC_KEEP if sync else self.store.result_ttl, payload, idempotency,
                                                 admission)
        if placed.queue is not None or placed.held is not None:
            if not sync:  # a held job too: the request that placed it may have been answered an instant ago
                with self._reachable():
                    await self.written.wait()
                    await self.copied.wait()  # a failover keeps what a replica has
            return Submitted(held=placed.held)
        if placed.limited is not None:
            limit, value = placed.limited
            raise TenantLimited(f"tenant {admission.tenant!r} is at its limit {limit} = {value}; retry once one of "
                                "its jobs has ended", {"Retry-After": "1"}, admission.tenant, limit)
        if placed.full:
            raise QueueFull()
        if placed.crowding is not None:
            mine, everyone = placed.crowding
            raise TenantLimited(f"the job queue is nearly full (its Redis nears its maxmemory), and tenant "
                                f"{admission.tenant!r} holds {mine} of the {everyone} async jobs it keeps (queued, or "
                                f"ended and kept for their readers), more than its share (its weight "
                                f"{admission.weight:g} of all tenants' "
                                f"{admission.shared_weight:g}): its async jobs are refused until it holds no more (as "
                                "its jobs end and their kept results expire), so that other tenants' still get in; "
                                "sync requests are not held by this; retry later",
                                {"Retry-After": "5"}, admission.tenant, "queue_share")
        if placed.no_worker:
            raise NoWorker("no worker is live yet (starting up, or all engines down); retry shortly",
                           {"Retry-After": "5"})
        soonest = placed.soonest or 0.0
        retry = max(1, math.ceil(soonest - remaining))
        raise Overloaded(f"every worker's queue would finish this request after its deadline "
                         f"({remaining:.0f} s); retry in {retry} s", {"Retry-After": str(retry)})

    async def run(self, job: JobSpec, timeout: float,
                  admission: Admission = Admission(lane=Lane.interactive, sync=True)) -> JobOutcome | None:
        """Submit `job` as a sync job (`admission`: whose, in which lane) and wait for its outcome, which
        is then removed from Redis (no one else can read it); None if `timeout` seconds pass first;
        SyncJobLost if its record
        vanishes meanwhile. The notice is expected before the job is placed, so nothing is read before
        it arrives; a notice that carries the outcome is the answer (the record is dropped after, off
        the request's path), any other sends the waiter to the record."""
        future = self.waiter.expect(job.id)
        try:
            await self.submit(job, admission)
            give_up = time.monotonic() + timeout
            while True:
                left = give_up - time.monotonic()
                if left <= 0:
                    return None
                await asyncio.wait((future,), timeout=min(left, RECHECK_INTERVAL))
                if future.done() and (announced := future.result()) is not None:
                    return JobOutcome.model_validate_json(announced)
                with self._reachable():
                    status, outcome = await self.store.collect(job.id)
                if status is None:
                    raise SyncJobLost(job.id)
                if outcome is not None:
                    return outcome
        finally:
            self.waiter.forget(job.id, future)

    def end_soon(self, job_id: str, message: str) -> None:
        """End the sync job of a request the stopping server cut short (answered 503, its client told to send it
        again) as cancelled, in the background: queued, it is taken off its queue; running, it is aborted. Nobody
        reads it now, so no engine time goes to it. `settle` waits for these before the process lets Redis go."""
        self._endings.start(self.cancel(job_id, JobStatus.cancelled, "unavailable_error", message, 503),
                            f"job {job_id}: not ended as its request was cut short")

    async def settle(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the endings `end_soon` started."""
        await self._endings.wait(timeout)

    async def wait(self, job_id: str, timeout: float) -> None:
        """Return once the async job `job_id` has ended or is gone, or after `timeout` seconds."""
        future = self.waiter.expect(job_id)
        try:
            give_up = time.monotonic() + timeout
            while True:
                record = await self.get(job_id)
                left = give_up - time.monotonic()
                if record is None or record.status.terminal or left <= 0:
                    return
                done, _ = await asyncio.wait((future,), timeout=min(left, RECHECK_INTERVAL))
                if done:
                    return
        finally:
            self.waiter.forget(job_id, future)

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record; None if unknown or expired."""
        with self._reachable():
            return await self.store.get(job_id)

    async def cancel(self, job_id: str, status: JobStatus, error_type: str, message: str, http_status: int,
                     after_deadline: float | None = None) -> bool:
        """End the job as `status` unless it already ended, and have its worker abort it (arq's abort);
        True when this call ended it. With `after_deadline`: only once its deadline is that far past."""
        outcome = JobOutcome(status=status, error={"error_type": error_type, "message": message},
                             http_status=http_status)
        with self._reachable():
            return await self.store.cancel(job_id, outcome, after_deadline)


class AppendOnlyFile:
    """Redis's append-only file, as INFO reports it. Redis writes a command to the file before it
    replies, except while its background fsync of the previous second is still running: then it keeps
    the write in its buffer for up to 2 s and replies anyway, and a crash of Redis in that window loses
    an acknowledged write (with another process writing and fsyncing on the same disk, 4–10 % of
    acknowledged writes were not yet in the file: bench/RESULTS-durability.md). An async job's 202 is a promise
    to answer it, so it waits here until the job's write is in the file."""

    def __init__(self, redis: Redis, timeout: float = AOF_WAIT, poll: float = AOF_POLL) -> None:
        self.redis = redis
        self.timeout = timeout
        self.poll = poll
        self.readable = True  # False once INFO was refused (a managed Redis may forbid it)

    async def wait(self) -> bool:
        """Return once every write Redis acknowledged before this call is in its append-only file
        (one INFO when nothing is buffered, as nearly always); True if so, False without an AOF, with
        INFO refused, or after `timeout` s (logged: the job is accepted all the same)."""
        info = await self._persistence()
        if info is None or not info.get("aof_enabled"):
            return False
        # Everything executed before this INFO is in the file or in the buffer: written once the
        # file has grown past both (or the buffer was seen empty; a rewrite may shrink the file).
        written_at = info["aof_current_size"] + info["aof_buffer_length"]
        give_up = time.monotonic() + self.timeout
        while info["aof_buffer_length"] and info["aof_current_size"] < written_at:
            if time.monotonic() > give_up:
                log.warning("Redis kept a job's write out of its append-only file for %.1f s (a slow fsync); "
                            "accepted anyway", self.timeout)
                return False
            await asyncio.sleep(self.poll)
            info = await self._persistence()
            if info is None:
                return False
        return True

    async def _persistence(self) -> dict[str, Any] | None:
        if not self.readable:
            return None
        try:
            return await self.redis.info("persistence")
        except ResponseError as exc:
            self.readable = False
            log.warning("Redis refuses INFO persistence (%s): async jobs are acknowledged without waiting "
                        "for the append-only file", exc)
            return None


class Reachable:
    """Where the API reaches the queue's Redis: its errors become a 503 with Retry-After (the queue
    unreachable, or full), and the log says why once at the first, then every 10 s, and once when Redis
    answers again (each refused request is in the request log as well)."""

    def __init__(self) -> None:
        self.failures = RepeatedFailure(log, "the job queue's Redis")

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            self.failures.failed(exc, "requests that need it are answered 503 until it answers")
            raise queue_error(exc) from exc
        self.failures.succeeded()
