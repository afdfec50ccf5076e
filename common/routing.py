"""Prefix-hash routing: rendezvous (highest-random-weight) hashing of a prefix key over the live
workers, so the same prefix keeps landing on the GPU that has it cached, with a bound on how far
one worker's queue may run ahead of the others. The API routes inside Redis, in the step that enqueues
the job (common/queue/placement.py, whose Lua ranks workers by the same sha1 weights); this module holds
the prefix key and the ranking that Python code needs (moving a vanished worker's jobs, re-runs). The
rules' Python reference, which the placement script is tested against, is tests/routing_reference.py."""

from __future__ import annotations

import hashlib
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
