"""The arq worker beside one engine: pulls only its own queue, woken by a push instead of arq's
0.5 s polling, runs each job's evaluation, stores the outcome and announces it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from typing import Any

from arq import Worker
from arq.connections import ArqRedis, RedisSettings
from arq.constants import in_progress_key_prefix
from arq.jobs import SerializationError, deserialize_job_raw
from redis.exceptions import RedisError

from common import keys
from common.jobs import EvaluationJob, JobOutcome, JobStatus, deserialize, serialize
from common.jobstore import JobStore, Taken
from common.membership import HEARTBEAT_INTERVAL, WorkerCounters, WorkerInfo, heartbeat, leave
from common.settings import Settings
from worker.branch_slots import BranchSlots
from worker.engine_client import EngineAborted, EngineClient, EngineError
from worker.engine_health import EngineHealth, HealthPolicy
from worker.evaluation import JobEvaluation, outcome_timings
from worker.recovery import Lease, LeaseLost, reap_vanished_workers, resume_own_jobs
from worker.sglang_launcher import needs_warm_label_logprobs

log = logging.getLogger("openjev.worker")

EXIT_ENGINE_DOWN = 3  # the worker's exit status when its engine stopped answering (serve then stops)
EXIT_LEASE_LOST = 4  # ... when another process holds this worker id's lease
REAP_EVERY = 2  # heartbeats between looks for vanished workers' jobs
STORE_RETRY_DELAY = 0.5  # seconds between attempts to store an outcome while Redis is unreachable


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def evaluate(ctx: dict[str, Any], job: EvaluationJob, picked_at: float) -> JobOutcome:
    """Evaluate one job picked at `picked_at` and return how it ended."""
    if job.remaining(picked_at) <= 0:
        return _failure(JobStatus.expired, 504, "timeout_error",
                        "the job's deadline passed before a worker could start it", ctx["worker_id"])
    info: WorkerInfo = ctx["info"]
    info.running += 1
    try:
        outcome = await _run(ctx, job, picked_at)
    finally:
        info.running -= 1
    if outcome.status is JobStatus.succeeded:
        info.avg_job_seconds = _moving_average(info.avg_job_seconds, time.time() - picked_at)
    else:
        info.counters.jobs_failed += 1
    return outcome


def _log_job(job: EvaluationJob, outcome: JobOutcome) -> None:
    """One event per job: ids, outcome and stage figures; never the prompt or the answers."""
    t = outcome.timings
    level = logging.INFO if outcome.status is JobStatus.succeeded else logging.WARNING
    log.log(level, "job %s", outcome.status.value, extra={
        "event": "job", "job_id": job.id, "request_id": job.request_id, "worker_id": outcome.worker_id,
        "status": outcome.status.value, "questions": len(job.branches), "prefix_tokens": len(job.prefix_ids),
        "cached_tokens": outcome.cached_tokens, "queue_ms": round(t.queue * 1000, 2),
        "prefill_ms": round(t.prefill * 1000, 2), "branches_ms": round(t.branches * 1000, 2),
        "error_type": (outcome.error or {}).get("error_type")})


async def _run(ctx: dict[str, Any], job: EvaluationJob, picked_at: float) -> JobOutcome:
    """Evaluate; every way it can end becomes an outcome (a cancellation still propagates)."""
    worker_id: str = ctx["worker_id"]
    counters: WorkerCounters = ctx["info"].counters
    evaluation = JobEvaluation(job, ctx["engine"], ctx["slots"], ctx["settings"].branch_max_new_tokens)
    try:
        result = await evaluation.run()
    except TimeoutError:
        return _failure(JobStatus.expired, 504, "timeout_error", "the evaluation did not finish before its deadline",
                        worker_id)
    except EngineAborted as exc:
        counters.engine_errors += 1
        return _failure(JobStatus.failed, 503, "engine_aborted", str(exc), worker_id)
    except EngineError as exc:
        counters.engine_errors += 1
        log.warning("job %s: engine error: %s", job.id, exc)
        return _failure(JobStatus.failed, 502, "engine_error", str(exc), worker_id)
    finally:
        counters.aborts_sent += evaluation.aborts_sent
    counters.record_job(result.warm_call, result.branch_calls)
    return JobOutcome(status=JobStatus.succeeded, result=result.body, prefix_tokens=result.prefix_tokens,
                      cached_tokens=result.cached_tokens, timings=outcome_timings(job, picked_at, result),
                      worker_id=worker_id)


def _moving_average(previous: float, sample: float, weight: float = 0.2) -> float:
    return sample if previous == 0 else (1 - weight) * previous + weight * sample


def _failure(status: JobStatus, http_status: int, error_type: str, message: str, worker_id: str) -> JobOutcome:
    return JobOutcome(status=status, error={"error_type": error_type, "message": message}, http_status=http_status,
                      worker_id=worker_id)


class QueueWorker(Worker):
    """arq's worker over arq's job layout, with a lean path per job. It blocks on its wake list
    between polls: a new job's id arrives there and the job is taken (claimed, read and marked
    running in one script) within a round trip; the timeout keeps heartbeats and aborts on
    schedule. A job ends with one write that stores its outcome, announces it and removes it from
    the queue. Jobs in the queue are never deferred here: every job in it is due."""

    async def main(self) -> None:
        self._wakeups: set[asyncio.Future[object]] = set()
        if self._pool is None:
            self._pool = await self._connect()
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        self.store: JobStore = self.ctx["store"]
        wake = keys.wake_key(self.queue_name)
        token: bytes | None = None
        polled_at = 0.0
        while True:
            try:
                if (token not in (None, keys.WAKE_ALL) and self.job_counter < self.max_jobs
                        and time.monotonic() - polled_at < self.poll_delay_s):
                    await self.start_jobs([token])  # a new job's id: take just that one
                else:
                    await self._poll_iteration()
                    polled_at = time.monotonic()
                popped = await self.pool.blpop([wake], timeout=self.poll_delay_s)
                token = popped[1] if popped else None
            except (RedisError, OSError) as exc:  # Redis restarting: keep the jobs in hand, retry
                log.warning("queue unreachable (%r); retrying", exc)
                token = None
                await asyncio.sleep(0.5)

    async def _connect(self) -> ArqRedis:
        from arq.connections import create_pool

        return await create_pool(self.redis_settings, job_serializer=self.job_serializer,
                                 job_deserializer=self.job_deserializer, default_queue_name=self.queue_name)

    async def _poll_iteration(self) -> None:
        """Look at the whole queue (jobs whose wake-up was missed, moved here, or waiting for a
        slot) and at the abort set."""
        if self.job_counter < self.max_jobs:
            await self.start_jobs(await self.pool.zrange(self.queue_name, 0, self.queue_read_limit - 1))
        await self._cancel_aborted_jobs()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Take each job not already running here, while slots are free."""
        for raw_id in job_ids:
            if self.job_counter >= self.max_jobs:
                return  # the rest wait in the queue; a slot freeing wakes the loop
            job_id = raw_id.decode()
            if job_id in self.tasks:
                continue
            taken = await self.store.take(job_id, self.queue_name, self.ctx["worker_id"],
                                          int(self.in_progress_timeout_s * 1000))
            if taken is None:  # running elsewhere, finished, or moved to another queue meanwhile
                continue
            self.job_counter += 1
            task = self.loop.create_task(self._execute(job_id, taken))
            self.tasks[job_id] = self.job_tasks[job_id] = task
            task.add_done_callback(functools.partial(self._job_done, job_id))

    def _job_done(self, job_id: str, task: asyncio.Task[None]) -> None:
        was_full = self.job_counter >= self.max_jobs
        self.job_counter -= 1
        self.tasks.pop(job_id, None)
        self.job_tasks.pop(job_id, None)
        if not task.cancelled() and task.exception() is not None:  # its outcome could not be stored
            log.error("job %s: not finished (%r)", job_id, task.exception())
        if was_full:  # jobs may be waiting for this slot: look at the queue now, not at the next poll
            wakeup = asyncio.ensure_future(self.pool.lpush(keys.wake_key(self.queue_name), keys.WAKE_ALL))
            self._wakeups.add(wakeup)
            wakeup.add_done_callback(self._wakeups.discard)

    async def _execute(self, job_id: str, taken: Taken) -> None:
        """Run a taken job to its end. A shutdown leaves it in the queue to run again (here after a
        restart, or on a live worker once this one's lease lapses); an abort or any other end is
        stored with the job's removal from the queue."""
        picked_at = time.time()
        job: EvaluationJob | None = None
        try:
            job = self._read(job_id, taken)
            async with asyncio.timeout(self.job_timeout_s):
                outcome = await self._outcome(taken, job, picked_at)
        except asyncio.CancelledError:
            if job_id not in self.aborting_tasks:
                if self.ctx.get("exit_code") != EXIT_LEASE_LOST:  # else the claim is another worker's now
                    with contextlib.suppress(RedisError, OSError):
                        await asyncio.shield(self.pool.delete(in_progress_key_prefix + job_id))
                return
            self.aborting_tasks.discard(job_id)
            outcome = self._ended(JobStatus.cancelled, 499, "cancelled", "the job was cancelled")
        except TimeoutError:
            outcome = self._ended(JobStatus.expired, 504, "timeout_error", "the job ran past the worker's limit")
        except Exception:  # a bug: the caller gets a 500 now rather than a 504 at its deadline
            log.exception("job %s: the worker failed on it", job_id)
            outcome = self._ended(JobStatus.failed, 500, "api_error", "the worker failed on this job")
        await asyncio.shield(self._store(job_id, outcome, job.deadline_at if job else time.time()))
        if job is not None:
            _log_job(job, outcome)  # after the answer went out: logging is not on the caller's path

    async def _store(self, job_id: str, outcome: JobOutcome, deadline_at: float) -> None:
        """Store the outcome, retrying while Redis restarts (its append-only file keeps the job):
        the result is computed and its caller waits for it until the deadline."""
        while True:
            try:
                await self.store.finish(job_id, outcome, self.queue_name)
                return
            except (RedisError, OSError) as exc:
                if time.time() > deadline_at:
                    raise
                log.warning("job %s: storing its outcome failed (%r); retrying", job_id, exc)
                await asyncio.sleep(STORE_RETRY_DELAY)

    def _read(self, job_id: str, taken: Taken) -> EvaluationJob | None:
        """The job in the payload; None when it expired from the queue or cannot be read."""
        if not taken.payload:
            return None
        try:
            function, args, _, _, _ = deserialize_job_raw(taken.payload, deserializer=self.job_deserializer)
            if function != keys.JOB_FUNCTION or len(args) != 1:
                raise ValueError(f"not an evaluation job: {function}")
            return EvaluationJob.model_validate(args[0])
        except (SerializationError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            log.error("job %s: unreadable (%s)", job_id, exc)
            return None

    async def _outcome(self, taken: Taken, job: EvaluationJob | None, picked_at: float) -> JobOutcome:
        if not taken.runnable:  # already ended (cancelled, expired) or aborted while queued
            return self._ended(JobStatus.cancelled, 499, "cancelled", "the job ended before it started")
        if not taken.payload:
            return self._ended(JobStatus.expired, 504, "timeout_error", "the job expired in the queue")
        if job is None:
            return self._ended(JobStatus.failed, 500, "api_error", "the job record could not be read")
        if taken.attempt > self.max_tries:
            log.error("job %s: interrupted %d times; not run again", job.id, taken.attempt - 1)
            return self._ended(JobStatus.failed, 500, "api_error",
                               f"the job was interrupted {taken.attempt - 1} times; it was not run again")
        return await evaluate(self.ctx, job, picked_at)

    def _ended(self, status: JobStatus, http_status: int, error_type: str, message: str) -> JobOutcome:
        return _failure(status, http_status, error_type, message, self.ctx["worker_id"])


async def _startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    info: WorkerInfo = ctx["info"]
    redis: ArqRedis = ctx["redis"]
    ctx["store"] = JobStore(redis, settings.job_result_ttl)
    ctx["lease"] = lease = Lease(redis, info.id)
    await lease.acquire()
    await resume_own_jobs(redis, info.queue)
    health: EngineHealth = ctx["health"]
    await health.probe()  # never announce an engine nobody has checked
    info.engine_ok = health.routable
    await heartbeat(redis, info)
    ctx["health_watch"] = asyncio.create_task(health.watch())
    ctx["heartbeat"] = asyncio.create_task(_keep_alive(ctx))
    ctx["lease_keeper"] = asyncio.create_task(_hold_lease(ctx))
    log.info("worker %s serving queue %s against %s", info.id, info.queue, settings.engine_url)


async def _shutdown(ctx: dict[str, Any]) -> None:
    for name in ("heartbeat", "lease_keeper", "health_watch"):
        task = ctx.get(name)
        if task:
            task.cancel()
    with contextlib.suppress(RedisError, OSError):
        # Jobs left in the queue (waiting, or interrupted by this shutdown, which arq re-queues)
        # stay ours until the lease lapses: a restart with this id resumes them, otherwise a live
        # worker moves them. Only an empty queue lets the worker leave at once.
        left_behind = await ctx["redis"].zcard(ctx["info"].queue)
        await leave(ctx["redis"], ctx["info"].id, keep_membership=bool(left_behind))
        if not left_behind:
            await ctx["lease"].release()
    await ctx["engine"].close()
    await ctx["health"].close()


async def _hold_lease(ctx: dict[str, Any]) -> None:
    """Renew the lease on this worker's id every heartbeat interval, on its own schedule: a slow
    engine health check must never let it lapse while jobs run here (another worker would then
    move them and run them a second time). Stop the worker if another process took it."""
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        try:
            await ctx["lease"].renew()
        except LeaseLost as exc:
            log.error("%s; worker %s stops", exc, ctx["info"].id)
            ctx["exit_code"] = EXIT_LEASE_LOST
            ctx["worker"].handle_sig(15)
            return
        except (RedisError, OSError) as exc:  # Redis blips must not kill the lease loop
            log.warning("lease renewal failed: %r", exc)


async def _keep_alive(ctx: dict[str, Any]) -> None:
    """Heartbeat every interval with the engine's last known health (probed on its own schedule,
    so a slow probe never delays a heartbeat); move vanished workers' jobs; stop the worker when
    the engine is down."""
    health: EngineHealth = ctx["health"]
    info: WorkerInfo = ctx["info"]
    beats = 0
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        info.engine_ok = health.routable
        beats += 1
        try:
            await heartbeat(ctx["redis"], info)
            if info.engine_ok and beats % REAP_EVERY == 0:
                await reap_vanished_workers(ctx["redis"], ctx["store"])
        except (RedisError, OSError) as exc:  # Redis blips must not kill the heartbeat loop
            log.warning("heartbeat failed: %r", exc)
        if health.down.is_set():
            log.error("engine at %s is down; worker %s stops", ctx["settings"].engine_url, info.id)
            ctx["exit_code"] = EXIT_ENGINE_DOWN
            ctx["worker"].handle_sig(15)
            return


def build_worker(settings: Settings) -> QueueWorker:
    """A worker for this process, configured from `settings`."""
    worker_id = settings.worker_id or default_worker_id()
    queue = keys.queue_name(worker_id)
    backend_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    engine = EngineClient(settings.engine_url, backend_key, max_connections=settings.max_concurrent_branches + 8,
                          warm_token_ids_logprob=needs_warm_label_logprobs(settings.sglang_version))
    ctx: dict[str, Any] = {
        "settings": settings,
        "worker_id": worker_id,
        "engine": engine,
        "health": EngineHealth(settings.engine_url, HealthPolicy(interval=settings.engine_health_interval,
                                                                 timeout=settings.engine_health_timeout),
                               last_answer=lambda: engine.last_answer_at),
        "slots": BranchSlots(settings.max_concurrent_branches),
        "info": WorkerInfo(id=worker_id, queue=queue, model=settings.served_model_name,
                           max_jobs=settings.max_concurrent_requests, max_branches=settings.max_concurrent_branches,
                           started_at=time.time()),
    }
    worker = QueueWorker(
        functions=[_job_function()],
        queue_name=queue,
        redis_settings=RedisSettings.from_dsn(settings.redis_url),
        max_jobs=settings.max_concurrent_requests,
        job_timeout=max(settings.request_timeout, settings.job_timeout) + 30,
        keep_result=0,
        max_tries=3,
        poll_delay=0.5,
        allow_abort_jobs=True,
        handle_signals=True,
        job_serializer=serialize,
        job_deserializer=deserialize,
        on_startup=_startup,
        on_shutdown=_shutdown,
        ctx=ctx,
    )
    ctx["worker"] = worker
    return worker


def _job_function():
    """The function arq's Worker insists on registering. Jobs never go through arq's run_job:
    `QueueWorker._execute` reads each job and checks that it names this function."""
    from arq.worker import func

    return func(evaluate, name=keys.JOB_FUNCTION)


def run_worker(settings: Settings) -> int:
    """Run a worker until a signal or its engine goes away; the exit status says which."""
    worker = build_worker(settings)
    worker.run()
    return int(worker.ctx.get("exit_code", 0))
