"""Prefix-hash routing: rendezvous (highest-random-weight) hashing of a prefix key over the live
workers, so the same prefix keeps landing on the GPU that has it cached."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


def prefix_key(prefix_ids: Sequence[int], first_k: int | None = None) -> str:
    """A stable hash of the shared prefix token ids (only the first `first_k` when given)."""
    ids = prefix_ids if first_k is None else prefix_ids[:first_k]
    h = hashlib.blake2b(digest_size=16)
    for token in ids:
        h.update(token.to_bytes(4, "little", signed=False))
    return h.hexdigest()


def _weight(key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_workers(key: str, worker_ids: Sequence[str]) -> list[str]:
    """All workers, best first, for `key`: independent of the order they are listed in."""
    return sorted(worker_ids, key=lambda w: (_weight(key, w), w), reverse=True)


def load_bound(queue_lengths: dict[str, int], load_factor: float) -> int:
    """The most jobs one worker may hold after taking a new one: ⌈c × (total + 1) / n⌉
    (consistent hashing with bounded loads, Mirrokni et al.); never below 1."""
    total = sum(queue_lengths.values())
    return max(1, math.ceil(load_factor * (total + 1) / len(queue_lengths)))


def route_job(key: str, queue_lengths: dict[str, int], load_factor: float = 1.25) -> str:
    """The worker for `key`: its rendezvous first choice, unless taking the job would put that
    worker over `load_bound`, in which case the next worker in the ranking that stays within it."""
    if not queue_lengths:
        raise LookupError("no live worker")
    ranking = rank_workers(key, list(queue_lengths))
    bound = load_bound(queue_lengths, load_factor)
    for worker in ranking:
        if queue_lengths[worker] + 1 <= bound:
            return worker
    return ranking[0]
