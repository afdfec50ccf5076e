"""The job status record in Redis, shared by the API (creates, cancels, reads) and the workers
(start, finish). The first terminal write wins, atomically, and announces itself on pub/sub."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common import keys
from common.jobs import JobOutcome, JobStatus

_TERMINAL = [s.value for s in JobStatus if s.terminal]

# KEYS[1] job hash; ARGV: worker id. Queued (or re-run after a lost worker) -> running.
_START = """
local s = redis.call('HGET', KEYS[1], 'status')
if s ~= 'queued' and s ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'started_at', ARGV[2])
return 1
"""

# KEYS[1] job hash; ARGV: queue. A job moved off a vanished worker's queue is queued again, unless it
# already ended (its worker finished it just before vanishing): a finished job is never revived.
_REQUEUE = """
local s = redis.call('HGET', KEYS[1], 'status')
if s ~= 'queued' and s ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'queue', ARGV[1])
return 1
"""

# KEYS[1] job hash, KEYS[2] done channel; ARGV: status, outcome JSON, ttl, job id, terminal statuses...
# The notice carries the outcome ("<job id> <outcome JSON>"), so a waiter needs no second read.
_FINISH = """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 0 end
for i = 5, #ARGV do if s == ARGV[i] then return 0 end end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'outcome', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('PUBLISH', KEYS[2], ARGV[4] .. ' ' .. ARGV[2])
return 1
"""


@dataclass(frozen=True)
class JobRecord:
    """A job as the API reports it."""

    id: str
    status: JobStatus
    request_id: str
    created_at: float
    deadline_at: float
    queue: str
    worker: str | None
    outcome: JobOutcome | None


class JobStore:
    """Reads and writes job status records; one instance per process, over a shared Redis client."""

    def __init__(self, redis: Redis, result_ttl: int) -> None:
        self.redis = redis
        self.result_ttl = result_ttl
        self._start = redis.register_script(_START)
        self._finish = redis.register_script(_FINISH)
        self._requeue = redis.register_script(_REQUEUE)

    def stage_create(self, pipe: Pipeline, job_id: str, request_id: str, created_at: float, deadline_at: float,
                     queue: str) -> None:
        """Add to `pipe` the commands that record a new queued job; it lives until its deadline
        plus the result TTL."""
        key = keys.job_key(job_id)
        pipe.hset(key, mapping={
            "status": JobStatus.queued.value,
            "request_id": request_id,
            "created_at": repr(created_at),
            "deadline_at": repr(deadline_at),
            "queue": queue,
        })
        pipe.expire(key, int(deadline_at - created_at) + self.result_ttl)

    async def start(self, job_id: str, worker_id: str) -> bool:
        """Mark the job running on `worker_id`; False when it already ended (cancelled, expired)."""
        return bool(await self._start(keys=[keys.job_key(job_id)], args=[worker_id, repr(time.time())]))

    async def finish(self, job_id: str, outcome: JobOutcome) -> bool:
        """Store the outcome unless the job already ended; True when this write won."""
        won = await self._finish(
            keys=[keys.job_key(job_id), keys.DONE_CHANNEL],
            args=[outcome.status.value, outcome.model_dump_json(), self.result_ttl, job_id, *_TERMINAL],
        )
        return bool(won)

    async def requeue(self, job_id: str, queue: str) -> bool:
        """Note that the job moved to another worker's queue (after its worker disappeared); False,
        and nothing written, when the job already ended."""
        return bool(await self._requeue(keys=[keys.job_key(job_id)], args=[queue]))

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record, or None if unknown or expired."""
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.job_key(job_id))
        if not raw:
            return None
        return _record(job_id, {k.decode(): v.decode() for k, v in raw.items()})


def _record(job_id: str, fields: dict[str, Any]) -> JobRecord:
    outcome = fields.get("outcome")
    return JobRecord(
        id=job_id,
        status=JobStatus(fields["status"]),
        request_id=fields.get("request_id", ""),
        created_at=float(fields.get("created_at", 0.0)),
        deadline_at=float(fields.get("deadline_at", 0.0)),
        queue=fields.get("queue", ""),
        worker=fields.get("worker"),
        outcome=JobOutcome.model_validate(orjson.loads(outcome)) if outcome else None,
    )
