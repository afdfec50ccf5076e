"""Prefix-hash routing: rendezvous (highest-random-weight) hashing of a prefix key over the live
workers, so the same prefix keeps landing on the GPU that has it cached, with a bound on how far
one worker's queue may run ahead of the others. Pure functions of Redis state: every API replica
that reads the same queue lengths makes the same choice. This is the reference; the API routes
with the same rules inside Redis, in the step that enqueues the job (common/queue/placement.py)."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence


def prefix_key(prefix_ids: Sequence[int], first_k: int | None = None) -> str:
    """A stable hash of the shared prefix token ids (only the first `first_k` when given)."""
    ids = prefix_ids if first_k is None else prefix_ids[:first_k]
    # One pass in C over the ids as little-endian uint32 (the bytes the key has always hashed).
    return hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=16).hexdigest()


def _weight(key: str, worker_id: str) -> str:
    """sha1(key NUL worker id) in hex: what Redis's Lua computes too (common/queue/placement.py routes there)."""
    return hashlib.sha1(f"{key}\x00{worker_id}".encode(), usedforsecurity=False).hexdigest()


def rank_workers(key: str, worker_ids: Sequence[str]) -> list[str]:
    """All workers, best first, for `key`: independent of the order they are listed in."""
    return sorted(worker_ids, key=lambda w: (_weight(key, w), w), reverse=True)


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


def admit(key: str, chosen: str, finish_in: dict[str, float], remaining: float) -> str | None:
    """The worker that takes the job: `chosen` if it can finish the job within `remaining`
    seconds, else the first in `key`'s ranking that can (`finish_in`: each live worker's expected
    finish for a new job); None when none can (the caller answers 529)."""
    candidates = [chosen, *(w for w in rank_workers(key, list(finish_in)) if w != chosen)]
    return next((w for w in candidates if finish_in[w] <= remaining), None)


def round_robin(turn: int, worker_ids: Sequence[str]) -> str:
    """The worker whose turn it is (`turn` from a shared counter): ignores prefixes (benchmarks only)."""
    return sorted(worker_ids)[turn % len(worker_ids)]
