"""One job's evaluation: a warm call on the shared prefix, then the label-scoring branches, one per
question (or more, where a scoring scheme asks), sent in batched engine calls of as many branches as
the worker's slots grant at once; a grouped choice question's final round follows its first. On any
failure, timeout or cancellation the other calls are cancelled and every live branch rid is aborted in
the engine, so no GPU time goes to work nobody will read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.contract import SystemOneResponse, Usage
from common.jobs import Branch, JobSpec, Timings
from common.scoring import final_round_branches, question_answers
from worker.branch_slots import BranchSlots
from worker.engine_client import BranchPrompt, EngineClient, GenerateResult, SharedPrefix

DEFAULT_BATCH_SIZE = 64


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
