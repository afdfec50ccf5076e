"""arq's job function and one job's evaluation. `evaluate` starts a placement only if its record still
names it (common/queue/records.py), runs the job and stores how it ended, or queues it to run again when
its engine failed it (common/queue/reruns.py). The evaluation is a warm call on the shared prefix, then
the label-scoring branches, one per question (or more, where a scoring scheme asks), sent in batched
engine calls of as many branches as the worker's slots grant at once; a grouped choice question's final
round follows its first. On any failure, timeout or cancellation the other calls are cancelled and every
live branch rid is aborted in the engine, so no GPU time goes to work nobody will read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from arq import Worker
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.contract import SystemOneResponse, Usage
from common.jobs import Branch, JobOutcome, JobSpec, JobStatus, Timings
from common.queue import keys
from common.queue.leases import Lease
from common.queue.membership import WorkerCounters, WorkerInfo
from common.queue.records import JobStore, Started
from common.queue.replication import ReplicaCopy
from common.queue.reruns import run_again
from common.scoring import final_round_branches, question_answers
from common.settings import Settings
from worker.branch_slots import BranchSlots
from worker.engine_client import (
    BranchPrompt,
    EngineAborted,
    EngineClient,
    EngineError,
    EngineUnavailable,
    GenerateResult,
    SharedPrefix,
)
from worker.engine_health import EngineHealth
from worker.fencing import RunningJobs, StopReason
from worker.wakeups import WakeUps

log = logging.getLogger("openjev.worker")

DEFAULT_BATCH_SIZE = 64
MAX_ATTEMPTS = 3  # a job interrupted this many times (its worker died under it) is not run again
MAX_RUNS = 5  # a job is started at most this many times in all: an engine failure on the last one fails it
# Seconds a job waits, after its engine failed it the 1st, 2nd, ... time, before it is queued again: a
# first failure moves on at once; later ones give a restarting engine (or a fleet whose engines all
# failed at once) time to answer again, instead of spending every start in a moment.
RERUN_DELAYS = (0.0, 1.0, 2.0, 4.0)
STORE_GRACE = 30.0  # seconds past a job's deadline its outcome store keeps retrying through Redis errors


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
    wakeups: WakeUps | None = None  # set at startup: what claims jobs (and hears wake-ups)
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
    # The job's start came with its claim (worker/wakeups.py). After a failed call nothing is claimed, so no
    # job starts (and spends one of its MAX_RUNS), until a probe finds the engine answering again; should it
    # be down for good, the worker stops and the job stays queued.
    started = state.wakeups.started(arq_job_id) if state.wakeups is not None else None
    if started is None:
        job_id = keys.job_of(arq_job_id)
        log.info("job %s: placement %s not run (moved, cancelled or ended meanwhile)", job_id, arq_job_id,
                 extra={"event": "placement_skipped", "job_id": job_id})
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




@dataclass(frozen=True)
class ExecutionResult:
    """The response body plus the figures the API reports in headers."""

    body: dict
    prefix_tokens: int
    warm_call: GenerateResult
    branch_calls: list[GenerateResult]  # one per branch
    call_sizes: list[int]  # prompts per engine call that carried the branches, in the order they were sent
    prefill_seconds: float
    branches_seconds: float

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the branch calls found in the engine's prefix cache; None when it does not say."""
        return _sum_or_none([r.cached_tokens for r in self.branch_calls])


class JobExecution:
    """Runs one job against one engine; `run()` either returns answers or leaves nothing live."""

    def __init__(self, job: JobSpec, engine: EngineClient, slots: BranchSlots, max_new_tokens: int = 1,
                 batch_size: int = DEFAULT_BATCH_SIZE, placement_id: str | None = None) -> None:
        """`batch_size`: the most branches sent in one engine call (1: one call per branch).
        `placement_id`: the queue placement being run (default: the job's id); its engine rids and its
        slot grants are named after it, so a job run again never shares a rid with its earlier run."""
        self.job = job
        self.placement_id = placement_id or job.id
        self.engine = engine
        self.slots = slots
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self._live: set[str] = set()  # rids sent to the engine and not yet answered
        self.aborts_sent = 0  # abort requests sent for this job's live calls
        self.call_sizes: list[int] = []  # prompts per branch call sent

    async def run(self) -> ExecutionResult:
        """Evaluate before the job's deadline (TimeoutError past it)."""
        try:
            async with asyncio.timeout(self.job.remaining()):
                return await self._evaluate()
        except BaseException:
            await asyncio.shield(self._abort_live())
            raise

    async def _evaluate(self) -> ExecutionResult:
        started = time.perf_counter()
        prefix = SharedPrefix(self.job.prefix_ids)
        rid = f"{self.placement_id}.warm"
        self._live.add(rid)
        warm = await self.engine.warm(prefix, rid, self.job.remaining())
        self._live.discard(rid)  # only on an answer: a failed or cancelled call stays to be aborted
        warmed = time.perf_counter()
        branches = self.job.branches
        results = await self._score_branches(prefix, branches)
        if self.job.final_rounds:
            finals = final_round_branches(branches, [r.label_logprobs for r in results], self.job.temperature,
                                          self.job.final_rounds)
            results += await self._score_branches(prefix, finals, first=len(branches))
            branches = [*branches, *finals]
        done = time.perf_counter()
        return ExecutionResult(
            body=self._response_body(warm, branches, results),
            prefix_tokens=len(self.job.prefix_ids),
            warm_call=warm,
            branch_calls=results,
            call_sizes=self.call_sizes,
            prefill_seconds=warmed - started,
            branches_seconds=done - warmed,
        )

    async def _score_branches(self, prefix: SharedPrefix, branches: list[Branch], first: int = 0
                              ) -> list[GenerateResult]:
        """Every branch's result, in branch order (rids numbered from `first`). Slots are asked for while
        earlier calls run; the first failure cancels the rest (TaskGroup) and is raised as itself."""
        prompts = [BranchPrompt(f"{self.placement_id}.b{i}", b.suffix_ids, b.label_ids)
                   for i, b in enumerate(branches, start=first)]
        results: list[GenerateResult] = []
        try:
            async with asyncio.TaskGroup() as group:
                calls = []
                sent = 0
                while sent < len(prompts):
                    granted = await self.slots.acquire(self.placement_id, min(self.batch_size, len(prompts) - sent))
                    call = group.create_task(self._score_batch(prefix, prompts[sent:sent + granted]))
                    # A done callback runs even for a task cancelled before it started: the slots always return.
                    call.add_done_callback(lambda _, n=granted: self.slots.release(n))
                    calls.append(call)
                    sent += granted
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        for call in calls:
            results += call.result()
        return results

    async def _score_batch(self, prefix: SharedPrefix, prompts: list[BranchPrompt]) -> list[GenerateResult]:
        rids = [p.rid for p in prompts]
        self._live.update(rids)
        self.call_sizes.append(len(prompts))
        results = await self.engine.score_branches(prefix, prompts, self.job.remaining(), self.max_new_tokens)
        self._live.difference_update(rids)  # only on an answer: a failed or cancelled call stays to be aborted
        return results

    async def _abort_live(self) -> None:
        live, self._live = self._live, set()
        self.aborts_sent += len(live)
        await asyncio.gather(*(self.engine.abort(rid) for rid in live))

    def _response_body(self, warm: GenerateResult, branches: list[Branch], results: list[GenerateResult]) -> dict:
        job = self.job
        answers = question_answers(branches, [r.label_logprobs for r in results], job.temperature, job.confidence)
        input_tokens = warm.prompt_tokens + sum(r.prompt_tokens for r in results)
        # Built through the contract's models, so the body is what the schema declares, field for field.
        return SystemOneResponse(model=job.model, answers=answers,
                                 usage=Usage(input_tokens=input_tokens, output_tokens=len(results) + 1)).model_dump()


def outcome_timings(job: JobSpec, picked_at: float, evaluation: ExecutionResult) -> Timings:
    """Stage durations for `Server-Timing` (prepare is measured by the API)."""
    return Timings(queue=max(0.0, picked_at - job.created_at), prefill=evaluation.prefill_seconds,
                   branches=evaluation.branches_seconds)


def _sum_or_none(values: list[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)
