"""The routing rules in Python: the reference that the placement script (common/queue/placement.py),
which routes inside Redis in the step that enqueues a job, is tested against (tests/test_dispatch.py),
and whose properties tests/test_routing.py checks. Pure functions of Redis state: every API replica
that reads the same queue lengths makes the same choice. The ranking itself is the product's
(common/routing.py `rank_workers`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.queue.membership import WorkerInfo
from common.routing import rank_workers


def load_bound(queue_lengths: dict[str, int], load_factor: float) -> int:
    """The most jobs one worker may hold once a new job is placed: c × the average queue length
    counting the new job, rounded up to whole jobs, ⌈c·(total + 1)/n⌉ (consistent hashing with
    bounded loads, Mirrokni et al. 2018)."""
    return math.ceil(load_factor * (sum(queue_lengths.values()) + 1) / len(queue_lengths))


def route_job(key: str, queue_lengths: dict[str, int], load_factor: float = 1.25) -> str:
    """The worker for `key`: the first in its ranking whose queue, with this job added, stays
    within `load_bound`; a worker that would go over it is passed over for the next.

    `queue_lengths`: queue length per live worker id (the API counts jobs waiting for a slot);
    `load_factor`: c ≥ 1. Some worker always qualifies (the shortest queue is at most the average),
    so the walk ends within the ranking."""
    if not queue_lengths:
        raise LookupError("no live worker")
    if load_factor < 1:
        raise ValueError(f"load_factor must be at least 1, not {load_factor}")
    bound = load_bound(queue_lengths, load_factor)
    return next(w for w in rank_workers(key, list(queue_lengths)) if queue_lengths[w] + 1 <= bound)


def expected_finish(info: WorkerInfo, lower: int) -> float:
    """Seconds a new job would take on `info`'s worker, where `lower` jobs are queued at lower scores than
    its own (those that start before it, the running ones among them): the jobs waiting ahead drain
    `max_jobs` at a time, then it runs."""
    ahead = max(0, lower - info.running) + max(0, info.running - info.max_jobs + 1)
    return (ahead / info.max_jobs + 1) * info.avg_job_seconds


def admit(key: str, chosen: str, finish_in: dict[str, float], remaining: float) -> str | None:
    """The worker that takes the job: `chosen` if it can finish the job within `remaining`
    seconds, else the first in `key`'s ranking that can (`finish_in`: each live worker's expected
    finish for a new job); None when none can (the caller answers 529)."""
    candidates = [chosen, *(w for w in rank_workers(key, list(finish_in)) if w != chosen)]
    return next((w for w in candidates if finish_in[w] <= remaining), None)


def round_robin(turn: int, worker_ids: Sequence[str]) -> str:
    """The worker whose turn it is (`turn` from a shared counter): ignores prefixes (benchmarks only)."""
    return sorted(worker_ids)[turn % len(worker_ids)]
