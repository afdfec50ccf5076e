"""A worker's claim of one placement on its own queue: what arq's `Worker.start_jobs` checks and writes
(no claim held by another, still queued, due), in one script (arq_layout.py `arq_claim`) instead of arq's
four round trips (WATCH, EXISTS, ZSCORE, then MULTI/PSETEX/EXEC). worker/wakeups.py then hands the job to
arq's own `Worker.run_job`. The claim names the worker process that holds it (its worker id and a token
of its own), so a claim whose reply the process lost (Redis restarting, the connection cut) is taken again
at its next look at the queue instead of standing until it expires, while one held by another process (a
paused one whose lease lapsed, or arq's own "1") is left alone."""

from __future__ import annotations

import secrets

from arq.utils import timestamp_ms
from redis.asyncio import Redis

from common.queue.arq_layout import ARQ_LUA

# KEYS[1] the queue; ARGV: arq job id, the claiming worker's id, its clock (ms), how long the claim holds (ms).
_CLAIM = ARQ_LUA + """
return arq_claim(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
"""


class Claims:
    """Claims placements on `queue` for this process of worker `worker_id`, each held `hold_s` seconds
    (arq's `in_progress_timeout_s`: longer than any job runs)."""

    def __init__(self, redis: Redis, queue: str, worker_id: str, hold_s: float) -> None:
        self.queue = queue
        self.holder = f"{worker_id}/{secrets.token_hex(4)}"
        self.hold_ms = int(hold_s * 1000)
        self._claim = redis.register_script(_CLAIM)

    async def claim(self, arq_job_id: str) -> int | None:
        """The placement's score once it is claimed here; None when it is not to be run here now (claimed
        by another, no longer queued, or deferred). The worker's own clock decides what is due, as arq's."""
        score = await self._claim(keys=[self.queue], args=[arq_job_id, self.holder, timestamp_ms(), self.hold_ms])
        return None if score is None else int(float(score))
