"""The arq worker beside one engine: arq's own `Worker`, configured through its settings and hooks,
runs `evaluate` (worker/evaluation.py) for each placement of this worker's queue, started at once by new
and cancelled placements and on a regular look at the queue (worker/wakeups.py, the one place jobs are
claimed); arq's poll reads cancellations. Around it: the heartbeat
(membership and the engine's state), the lease and its fencing (worker/fencing.py), and moving
vanished workers' jobs. Every Redis write goes through common/queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from typing import Any

from arq import Worker
from arq.connections import ArqRedis
from arq.worker import func
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.heap import freeze_startup_heap
from common.jobs import deserialize, serialize
from common.logs import RepeatedFailure
from common.queue import keys
from common.queue.leases import Lease, LeaseLapsed, LeaseTaken, beat, reap_vanished_workers, resume_own_jobs
from common.queue.membership import (
    HEARTBEAT_INTERVAL,
    LIVENESS_WINDOW,
    RESTING_HEARTBEAT_INTERVAL,
    WorkerInfo,
    heartbeat,
    leave,
)
from common.queue.presence import unseen_before
from common.queue.records import JobStore
from common.queue.replication import ReplicaCopy
from common.redis_connection import redis_connection
from common.settings import Settings
from worker.branch_slots import BranchSlots
from worker.engine_client import EngineClient
from worker.engine_health import EngineHealth, HealthPolicy
from worker.evaluation import MAX_ATTEMPTS, WorkerState, evaluate
from worker.fencing import RunningJobs, take_back
from worker.sglang_launcher import needs_warm_label_logprobs
from worker.wakeups import WakeUps

log = logging.getLogger("openjev.worker")

EXIT_ENGINE_DOWN = 3  # the worker's exit status when its engine stopped answering (serve then stops)
EXIT_LEASE_LOST = 4  # ... when another process holds this worker id's lease
REDIS_RETRIES = 3600  # ~an hour of 1 s backoffs: a worker waits out a Redis restart rather than exiting


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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
    state.wakeups = WakeUps(redis, info.queue, state.worker, state.running, worker_id=info.id,
                            look_interval=settings.worker_poll_delay,
                            unseen_before=unseen_before(settings.api_presence_ttl), counters=info.counters,
                            sync_deadline=settings.request_timeout,
                            listen=settings.worker_wakeups,
                            ready=health.answering)
    await state.wakeups.start()  # before the first heartbeat: a job placed once we are routable wakes us
    await heartbeat(redis, info)
    state.tasks["health_watch"] = asyncio.create_task(health.watch())
    state.tasks["heartbeat"] = asyncio.create_task(_keep_alive(state))
    freeze_startup_heap()
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
    failures = RepeatedFailure(log, "heartbeat")
    moves = RepeatedFailure(log, "moving vanished workers' jobs")  # tried again at each beat that sees them
    # Since when the beats have gone through on time. A beat that failed, waited for Redis (its client retries
    # through an outage: over half a liveness window) or found its own lease lapsed means Redis was away for
    # every worker alike, and the others come back at their own pace (a backoff, a beat interval): until one
    # liveness window has passed, their silence is not taken for death, so the first worker back does not move
    # the jobs of the rest (a Redis restart once moved 25 jobs of a worker that beat again 3 s after Redis did).
    steady_since = -math.inf
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL if info.running else RESTING_HEARTBEAT_INTERVAL)
        info.engine_ok = health.routable
        started = time.monotonic()
        try:
            silent = await _beat(state)
            now = time.monotonic()
            if failures.failures or silent is None or now - started > LIVENESS_WINDOW / 2:
                steady_since = now
            elif silent and now - steady_since >= LIVENESS_WINDOW:
                _move_jobs_of_silent(state, moves)
            failures.succeeded()
        except LeaseTaken as exc:
            log.error("%s; worker %s stops", exc, info.id)
            state.exit_code = EXIT_LEASE_LOST
            state.worker.handle_sig(15)
            return
        except (RedisError, OSError) as exc:  # a Redis blip must not end the loop; a long one lapses the lease
            failures.failed(exc, "the next beat tries again")
        if health.down.is_set():
            log.error("engine at %s is down; worker %s stops", state.settings.engine_url, info.id)
            state.exit_code = EXIT_ENGINE_DOWN
            state.worker.handle_sig(15)
            return


async def _beat(state: WorkerState) -> list[str] | None:
    """One beat: the silent members it saw, or None when its own lease had lapsed (then taken back)."""
    try:
        return await beat(state.redis, state.info, state.lease)
    except LeaseLapsed:
        await take_back(state.lease, state.running, state.store)  # raises LeaseTaken if it is not ours now
        return None


def _move_jobs_of_silent(state: WorkerState, moves: RepeatedFailure) -> None:
    """Move the jobs of silent members whose leases lapsed, in the background: a long move must not delay the
    next beat. Not while this worker's engine is out (it would take none of them), nor twice at once."""
    reaping = state.tasks.get("reaping")
    if state.info.engine_ok and (reaping is None or reaping.done()):
        state.tasks["reaping"] = asyncio.create_task(_reap(state.redis, moves))


async def _reap(redis: Redis, moves: RepeatedFailure) -> None:
    try:
        await reap_vanished_workers(redis)
    except (RedisError, OSError) as exc:
        moves.failed(exc, "the next beat that sees them tries again")
    else:
        moves.succeeded()


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
    loop ends on the first error it sees (its poll here reads only cancellations; claims are
    worker/wakeups.py's, which survive a broken one), so every command waits (backing off to 1 s) until Redis
    answers again."""
    return redis_connection(settings, retries=REDIS_RETRIES)


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (uvicorn[standard] installs it everywhere but on Windows), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_worker(settings: Settings) -> int:
    """Run a worker until a signal or its engine goes away; the exit status says which. arq runs on the
    loop current when its Worker is built: uvloop's where it is installed, as for the API's uvicorn."""
    asyncio.set_event_loop(_event_loop())
    worker = build_worker(settings)
    worker.run()
    state: WorkerState = worker.ctx["state"]
    return state.exit_code
