"""The arq worker beside one engine: arq's own `Worker`, configured through its settings and hooks,
pulls only this worker's queue and runs `evaluate` for each placement, woken at once by new and
cancelled placements (worker/wakeups.py) and polling as a fallback. Around it: the heartbeat
(membership and the engine's state), the lease and its fencing (worker/fencing.py), and moving
vanished workers' jobs. Every Redis write goes through common/queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from arq import Worker
from arq.connections import ArqRedis
from arq.worker import func
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.jobs import JobOutcome, JobSpec, JobStatus, deserialize, serialize
from common.queue import keys
from common.queue.leases import Lease, LeaseLapsed, LeaseTaken, beat, reap_vanished_workers, resume_own_jobs
from common.queue.membership import (
    HEARTBEAT_INTERVAL,
    RESTING_HEARTBEAT_INTERVAL,
    WorkerCounters,
    WorkerInfo,
    heartbeat,
    leave,
)
from common.queue.records import JobStore, Started
from common.queue.replication import ReplicaCopy
from common.queue.reruns import run_again
from common.redis_connection import redis_connection
from common.settings import Settings
from worker.branch_slots import BranchSlots
from worker.engine_client import EngineAborted, EngineClient, EngineError, EngineUnavailable
from worker.engine_health import EngineHealth, HealthPolicy
from worker.evaluation import JobExecution, outcome_timings
from worker.fencing import RunningJobs, StopReason, take_back
from worker.sglang_launcher import needs_warm_label_logprobs
from worker.wakeups import WakeUps

log = logging.getLogger("openjev.worker")

EXIT_ENGINE_DOWN = 3  # the worker's exit status when its engine stopped answering (serve then stops)
EXIT_LEASE_LOST = 4  # ... when another process holds this worker id's lease
MAX_ATTEMPTS = 3  # a job interrupted this many times (its worker died under it) is not run again
MAX_RUNS = 5  # a job is started at most this many times in all: an engine failure on the last one fails it
# Seconds a job waits, after its engine failed it the 1st, 2nd, ... time, before it is queued again: a
# first failure moves on at once; later ones give a restarting engine (or a fleet whose engines all
# failed at once) time to answer again, instead of spending every start in a moment.
RERUN_DELAYS = (0.0, 1.0, 2.0, 4.0)
REDIS_RETRIES = 3600  # ~an hour of 1 s backoffs: a worker waits out a Redis restart rather than exiting
STORE_GRACE = 30.0  # seconds past a job's deadline its outcome store keeps retrying through Redis errors


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RunAgain(Exception):
    """The engine failed the job (not the request's fault) and the job may still be started again."""


@dataclass
class WorkerState:
    """What the job function and the worker's hooks share. arq hands its hooks and job functions a
    dict (`ctx`); this process's state rides in it under "state", beside arq's own per-job entries
    (`job_id`, `job_try`)."""

    settings: Settings
    info: WorkerInfo  # what the heartbeat publishes: id, queue, load, counters
    engine: EngineClient
    health: EngineHealth
    slots: BranchSlots
    running: RunningJobs
    exit_code: int = 0  # EXIT_ENGINE_DOWN or EXIT_LEASE_LOST once the worker stops for that reason
    wakeups: WakeUps | None = None  # with OPENJEV_WORKER_WAKEUPS
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # heartbeat, health watch, reaping
    # Set once arq's worker exists (`worker`) and at its startup (the rest): arq opens the Redis pool.
    worker: Worker = field(init=False)
    redis: Redis = field(init=False)
    store: JobStore = field(init=False)
    replicas: ReplicaCopy = field(init=False)
    lease: Lease = field(init=False)

    @property
    def worker_id(self) -> str:
        return self.info.id


async def evaluate(ctx: dict[str, Any], payload: dict[str, Any]) -> None:
    """arq's job function: run one placement of an evaluation job and store how it ended, or, when its
    engine failed it, queue it to run again (common/queue/reruns.py). A placement that is no longer its
    job's (moved, cancelled, expired) is neither run nor stored."""
    state: WorkerState = ctx["state"]
    arq_job_id: str = ctx["job_id"]
    store = state.store
    # After a failed call, no job starts (and spends one of its MAX_RUNS) until a probe finds the engine
    # answering again; should it be down for good, the worker stops and arq keeps the job queued.
    await state.health.answering.wait()
    started = await store.start(arq_job_id, state.worker_id)
    if started is None:
        return
    picked_at = time.time()
    running = state.running
    job: JobSpec | None = None
    try:
        with running.running(arq_job_id):
            job = JobSpec.model_validate(payload)
            outcome = await _outcome(state, job, arq_job_id, ctx["job_try"], started, picked_at)
    except asyncio.CancelledError:
        reason = running.stopped_because(arq_job_id)
        if reason is None:
            raise  # arq's abort (its ending is already stored) or a shutdown (the job stays queued to resume)
        if reason is StopReason.moved:
            log.warning("job %s: moved off this worker while it was cut off; stopped here", keys.job_of(arq_job_id))
        else:
            log.info("job %s: cancelled; stopped here", keys.job_of(arq_job_id))
        return  # either way its ending is not ours to store; arq finishes the placement
    except RunAgain as again:
        await _run_again(state, arq_job_id, started, str(again))
        return  # the job lives on as its next placement; arq finishes this one
    except ValidationError as exc:
        log.error("job %s: unreadable (%s)", arq_job_id, exc)
        outcome = _failure(JobStatus.failed, 500, "api_error", "the job record could not be read", state)
    outcome.attempts = started.attempts
    give_up_at = time.monotonic() + max(0.0, started.remaining) + STORE_GRACE
    stored = await asyncio.shield(store.store(arq_job_id, outcome, give_up_at))
    if stored:  # the outcome on a replica before arq ends the placement: a failover neither loses nor reruns it
        with contextlib.suppress(RedisError, OSError):
            await asyncio.shield(state.replicas.wait())
    state.info.counters.record_ending(outcome.status.value if stored else "refused")
    if job is not None:
        _log_job(job, outcome, stored)  # after the answer went out: logging is not on the caller's path


async def _outcome(state: WorkerState, job: JobSpec, arq_job_id: str, job_try: int, started: Started,
                   picked_at: float) -> JobOutcome:
    """`job_try`: arq's count of this placement's tries (one more each time its worker died under it)."""
    if started.remaining <= 0:
        return _failure(JobStatus.expired, 504, "timeout_error",
                        "the job's deadline passed before a worker could start it", state)
    if job_try > MAX_ATTEMPTS:
        log.error("job %s: interrupted %d times; not run again", job.id, job_try - 1)
        return _failure(JobStatus.failed, 500, "api_error",
                        f"the job was interrupted {job_try - 1} times; it was not run again", state)
    # The job on this host's clock (Redis's clock said how long it waited and how long it has left).
    local = job.model_copy(update={"created_at": picked_at - started.waited,
                                   "deadline_at": picked_at + started.remaining})
    info = state.info
    info.running += 1
    try:
        outcome = await _run(state, local, arq_job_id, picked_at, started.attempts)
    finally:
        info.running -= 1
    if outcome.status is JobStatus.succeeded:
        info.avg_job_seconds = _moving_average(info.avg_job_seconds, time.time() - picked_at)
    else:
        info.counters.jobs_failed += 1
    return outcome


async def _run(state: WorkerState, job: JobSpec, placement_id: str, picked_at: float, attempt: int) -> JobOutcome:
    """Evaluate; every way it can end becomes an outcome (a cancellation still propagates), except an
    engine failure with starts to spare, which raises RunAgain."""
    counters: WorkerCounters = state.info.counters
    settings = state.settings
    evaluation = JobExecution(job, state.engine, state.slots, settings.branch_max_new_tokens,
                              settings.branch_batch_size, placement_id)
    try:
        result = await evaluation.run()
    except TimeoutError:
        return _failure(JobStatus.expired, 504, "timeout_error", "the evaluation did not finish before its deadline",
                        state)
    except EngineUnavailable as exc:
        counters.engine_errors += 1
        state.health.suspect()  # out of routing until a probe finds the engine healthy again
        if attempt < MAX_RUNS:
            raise RunAgain(str(exc)) from exc
        log.warning("job %s: engine error on attempt %d of %d; not run again: %s", job.id, attempt, MAX_RUNS, exc)
        message = f"{exc} (attempt {attempt} of {MAX_RUNS})"
        if isinstance(exc, EngineAborted):
            return _failure(JobStatus.failed, 503, "engine_aborted", message, state)
        return _failure(JobStatus.failed, 502, "engine_error", message, state)
    except EngineError as exc:  # the request refused (a 4xx) or an answer not to be trusted: it would fail again
        counters.engine_errors += 1
        log.warning("job %s: engine error: %s", job.id, exc)
        return _failure(JobStatus.failed, 502, "engine_error", str(exc), state)
    finally:
        counters.aborts_sent += evaluation.aborts_sent
    counters.record_job(result.warm_call, result.branch_calls, result.call_sizes)
    return JobOutcome(status=JobStatus.succeeded, result=result.body, prefix_tokens=result.prefix_tokens,
                      cached_tokens=result.cached_tokens, timings=outcome_timings(job, picked_at, result),
                      worker_id=state.worker_id)


async def _run_again(state: WorkerState, arq_job_id: str, started: Started, reason: str) -> None:
    """After a pause (RERUN_DELAYS), queue the job to run again. Should this worker stop meanwhile, or
    Redis be unreachable, arq keeps this placement queued for a restart of this worker (or a live worker
    moves it) once this one stops."""
    await asyncio.sleep(RERUN_DELAYS[min(started.attempts, len(RERUN_DELAYS)) - 1])
    try:
        rerun = await asyncio.shield(run_again(state.redis, arq_job_id, state.worker_id,
                                               f"{state.worker_id}: {reason}"))
    except (RedisError, OSError) as exc:
        log.error("job %s: its engine failed and it could not be queued again (%r)", keys.job_of(arq_job_id), exc)
        return
    if rerun is None:
        return  # it ended, was cancelled or moved meanwhile
    state.info.counters.jobs_rerun += 1
    where = "here, once its engine answers" if rerun.own else f"on {rerun.queue}"
    log.warning("job %s: engine failed attempt %d (%s); runs again %s", keys.job_of(arq_job_id),
                started.attempts, reason, where,
                extra={"event": "job_rerun", "job_id": keys.job_of(arq_job_id), "attempt": started.attempts,
                       "queue": rerun.queue})


def _log_job(job: JobSpec, outcome: JobOutcome, stored: bool) -> None:
    """One event per job: ids, outcome and stage figures; never the prompt or the answers."""
    t = outcome.timings
    level = logging.INFO if outcome.status is JobStatus.succeeded and stored else logging.WARNING
    log.log(level, "job %s", outcome.status.value if stored else "refused", extra={
        "event": "job", "job_id": job.id, "request_id": job.request_id, "worker_id": outcome.worker_id,
        "status": outcome.status.value, "stored": stored, "questions": len(job.branches),
        "prefix_tokens": len(job.prefix_ids), "cached_tokens": outcome.cached_tokens,
        "queue_ms": round(t.queue * 1000, 2), "prefill_ms": round(t.prefill * 1000, 2),
        "branches_ms": round(t.branches * 1000, 2), "error_type": (outcome.error or {}).get("error_type")})


def _moving_average(previous: float, sample: float, weight: float = 0.2) -> float:
    return sample if previous == 0 else (1 - weight) * previous + weight * sample


def _failure(status: JobStatus, http_status: int, error_type: str, message: str, state: WorkerState) -> JobOutcome:
    return JobOutcome(status=status, error={"error_type": error_type, "message": message}, http_status=http_status,
                      worker_id=state.worker_id)


async def _startup(ctx: dict[str, Any]) -> None:
    state: WorkerState = ctx["state"]
    settings, info = state.settings, state.info
    state.redis = redis = ctx["redis"]  # arq's pool, opened by arq before this hook
    state.store = JobStore(redis, settings.job_result_ttl, settings.longest_job_seconds)
    state.replicas = ReplicaCopy(redis)
    state.lease = lease = Lease(redis, info.id)
    await lease.acquire()
    await resume_own_jobs(redis, info.queue)
    health = state.health
    await health.probe()  # never announce an engine nobody has checked
    info.engine_ok = health.routable
    if settings.worker_wakeups:
        state.wakeups = WakeUps(redis, info.queue, state.worker, state.running)
        await state.wakeups.start()  # before the first heartbeat: a job placed once we are routable wakes us
    await heartbeat(redis, info)
    state.tasks["health_watch"] = asyncio.create_task(health.watch())
    state.tasks["heartbeat"] = asyncio.create_task(_keep_alive(state))
    log.info("worker %s serving queue %s against %s", info.id, info.queue, settings.engine_url)


async def _shutdown(ctx: dict[str, Any]) -> None:
    state: WorkerState = ctx["state"]
    for task in state.tasks.values():
        task.cancel()
    if state.wakeups is not None:
        await state.wakeups.close()
    with contextlib.suppress(RedisError, OSError):
        # Jobs left in the queue (waiting, or interrupted by this shutdown, which arq keeps queued)
        # stay ours until the lease lapses: a restart with this id resumes them, otherwise a live
        # worker moves them. Only an empty queue lets the worker leave at once.
        left_behind = await state.redis.zcard(state.info.queue)
        await leave(state.redis, state.info.id, keep_membership=bool(left_behind))
        if not left_behind:
            await state.lease.release()
    await state.engine.close()
    await state.health.close()


async def _keep_alive(state: WorkerState) -> None:
    """Every heartbeat interval, one beat (common/queue/leases.py `beat`: one round trip): the
    heartbeat with the engine's last known health (probed on its own schedule, so a slow probe never
    delays a beat), the lease's renewal, and a look for vanished workers, whose jobs are moved in the
    background. Every second while jobs run, so the load the API routes by stays fresh; every two at
    rest, where nothing but liveness changes. Stops the worker when its engine is down or another
    process holds its lease."""
    health, info = state.health, state.info
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL if info.running else RESTING_HEARTBEAT_INTERVAL)
        info.engine_ok = health.routable
        try:
            await _beat(state)
        except LeaseTaken as exc:
            log.error("%s; worker %s stops", exc, info.id)
            state.exit_code = EXIT_LEASE_LOST
            state.worker.handle_sig(15)
            return
        except (RedisError, OSError) as exc:  # a Redis blip must not end the loop; a long one lapses the lease
            log.warning("heartbeat failed: %r", exc)
        if health.down.is_set():
            log.error("engine at %s is down; worker %s stops", state.settings.engine_url, info.id)
            state.exit_code = EXIT_ENGINE_DOWN
            state.worker.handle_sig(15)
            return


async def _beat(state: WorkerState) -> None:
    info = state.info
    try:
        silent = await beat(state.redis, info, state.lease)
    except LeaseLapsed:
        await take_back(state.lease, state.running, state.store)  # raises LeaseTaken if it is not ours now
        return
    reaping = state.tasks.get("reaping")
    if silent and info.engine_ok and (reaping is None or reaping.done()):
        state.tasks["reaping"] = asyncio.create_task(_reap(state.redis))  # a long move must not delay the next beat


async def _reap(redis: Redis) -> None:
    try:
        await reap_vanished_workers(redis)
    except (RedisError, OSError) as exc:  # the next beat sees the silent members again
        log.warning("moving vanished workers' jobs failed: %r", exc)


def build_worker(settings: Settings) -> Worker:
    """arq's worker for this process, configured from `settings`."""
    worker_id = settings.worker_id or default_worker_id()
    queue = keys.queue_name(worker_id)
    backend_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    engine = EngineClient(settings.engine_url, backend_key, max_connections=settings.max_concurrent_branches + 8,
                          warm_token_ids_logprob=needs_warm_label_logprobs(settings.sglang_version),
                          max_answer_bytes=settings.engine_max_answer_bytes, call_limit=settings.engine_call_limit)
    state = WorkerState(
        settings=settings,
        info=WorkerInfo(id=worker_id, queue=queue, model=settings.served_model_name,
                        max_jobs=settings.max_concurrent_requests, max_branches=settings.max_concurrent_branches,
                        started_at=time.time()),
        engine=engine,
        health=EngineHealth(settings.engine_url, HealthPolicy(interval=settings.engine_health_interval,
                                                              timeout=settings.engine_health_timeout),
                            last_seen_working=lambda: engine.last_seen_working),
        slots=BranchSlots(settings.max_concurrent_branches),
        running=RunningJobs(),
    )
    worker = Worker(
        functions=[func(evaluate, name=keys.JOB_FUNCTION)],
        queue_name=queue,
        redis_pool=_redis(settings),
        max_jobs=settings.max_concurrent_requests,
        job_timeout=settings.longest_job_seconds + 30,  # a backstop: each job ends itself at its deadline
        keep_result=0,  # the outcome lives in the job record, not in arq's result key
        max_tries=MAX_ATTEMPTS + 1,  # `evaluate` refuses the try past MAX_ATTEMPTS with an outcome
        poll_delay=settings.worker_poll_delay,
        allow_abort_jobs=True,
        handle_signals=True,
        log_results=False,
        job_serializer=serialize,
        job_deserializer=deserialize,
        on_startup=_startup,
        on_shutdown=_shutdown,
        ctx={"state": state},
    )
    state.worker = worker
    worker.on_stop = lambda _signal: _stop_wakeups(state)
    return worker


def _stop_wakeups(state: WorkerState) -> None:
    """The worker is stopping: no wake-up may start a job that arq's shutdown would then wait for."""
    if state.wakeups is not None:
        state.wakeups.stop()


def _redis(settings: Settings) -> ArqRedis:
    """The worker's Redis client, with retries that outlast a Redis restart or a failover: arq's poll
    loop ends on the first error it sees, so every command waits (backing off to 1 s) until Redis
    answers again."""
    return redis_connection(settings, retries=REDIS_RETRIES)


def run_worker(settings: Settings) -> int:
    """Run a worker until a signal or its engine goes away; the exit status says which."""
    worker = build_worker(settings)
    worker.run()
    state: WorkerState = worker.ctx["state"]
    return state.exit_code
