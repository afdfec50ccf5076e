"""One job's evaluation: a warm call on the shared prefix, then one label-scoring branch call per
question. On any failure, timeout or cancellation the sibling branches are cancelled and every
live rid is aborted in the engine, so no GPU time goes to work nobody will read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.jobs import Branch, EvaluationJob, Timings
from common.scoring import question_answers
from worker.branch_slots import BranchSlots
from worker.engine_client import EngineClient, GenerateResult


@dataclass(frozen=True)
class Evaluation:
    """The response body plus the figures the API reports in headers."""

    body: dict
    prefix_tokens: int
    warm_call: GenerateResult
    branch_calls: list[GenerateResult]
    prefill_seconds: float
    branches_seconds: float

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the branch calls found in the engine's prefix cache; None when it does not say."""
        return _sum_or_none([r.cached_tokens for r in self.branch_calls])


class JobEvaluation:
    """Runs one job against one engine; `run()` either returns answers or leaves nothing live."""

    def __init__(self, job: EvaluationJob, engine: EngineClient, slots: BranchSlots, max_new_tokens: int = 1) -> None:
        self.job = job
        self.engine = engine
        self.slots = slots
        self.max_new_tokens = max_new_tokens
        self._live: set[str] = set()  # rids sent to the engine and not yet answered
        self.aborts_sent = 0  # abort requests sent for this job's live calls

    async def run(self) -> Evaluation:
        """Evaluate before the job's deadline (TimeoutError past it)."""
        try:
            async with asyncio.timeout(self.job.remaining()):
                return await self._evaluate()
        except BaseException:
            await asyncio.shield(self._abort_live())
            raise

    async def _evaluate(self) -> Evaluation:
        started = time.perf_counter()
        warm = await self._call(f"{self.job.id}.warm", self.engine.warm(
            self.job.prefix_ids, f"{self.job.id}.warm", self.job.remaining()))
        warmed = time.perf_counter()
        results = await self._score_branches()
        done = time.perf_counter()
        return Evaluation(
            body=self._response_body(warm, results),
            prefix_tokens=len(self.job.prefix_ids),
            warm_call=warm,
            branch_calls=results,
            prefill_seconds=warmed - started,
            branches_seconds=done - warmed,
        )

    async def _score_branches(self) -> list[GenerateResult]:
        tasks = [asyncio.create_task(self._score_branch(i, b)) for i, b in enumerate(self.job.branches)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in done if t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _score_branch(self, index: int, branch: Branch) -> GenerateResult:
        rid = f"{self.job.id}.b{index}"
        async with self.slots.slot(self.job.id):
            return await self._call(rid, self.engine.score_labels(
                self.job.prefix_ids + branch.suffix_ids, branch.label_ids, rid, self.job.remaining(),
                self.max_new_tokens))

    async def _call(self, rid: str, call) -> GenerateResult:
        self._live.add(rid)
        result = await call
        self._live.discard(rid)  # only on an answer: a failed or cancelled call stays to be aborted
        return result

    async def _abort_live(self) -> None:
        live, self._live = self._live, set()
        self.aborts_sent += len(live)
        await asyncio.gather(*(self.engine.abort(rid) for rid in live))

    def _response_body(self, warm: GenerateResult, results: list[GenerateResult]) -> dict:
        job = self.job
        answers = question_answers(job.branches, [r.label_logprobs for r in results], job.temperature, job.confidence)
        input_tokens = warm.prompt_tokens + sum(r.prompt_tokens for r in results)
        return {
            "model": job.model,
            "answers": answers,
            "usage": {"input_tokens": input_tokens, "output_tokens": len(results) + 1},
        }


def outcome_timings(job: EvaluationJob, picked_at: float, evaluation: Evaluation) -> Timings:
    """Stage durations for `Server-Timing` (prepare is measured by the API)."""
    return Timings(queue=max(0.0, picked_at - job.created_at), prefill=evaluation.prefill_seconds,
                   branches=evaluation.branches_seconds)


def _sum_or_none(values: list[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)
