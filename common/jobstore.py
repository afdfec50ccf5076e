"""The job status record in Redis, shared by the API (creates, cancels, reads) and the workers
(take, finish, move). The first terminal write wins, atomically, and announces itself on pub/sub.

A worker takes a job and ends it in one round trip each: `take` claims it in arq's layout (the
in-progress key, the try counter, the abort set), reads its payload and marks the record running;
`finish` stores the outcome and removes the job from its queue in the same step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis

from common import keys
from common.jobs import JobOutcome, JobStatus

_TERMINAL = [s.value for s in JobStatus if s.terminal]

RETRY_KEY_TTL = 88400  # seconds, as long as arq keeps its try counters

# KEYS: job hash, in-progress key, queue, arq job key, try counter, abort set; ARGV: job id, in-progress
# ttl (ms), worker id, now, try counter ttl (s). Nothing when the job has left the queue or runs
# elsewhere; otherwise the job is claimed as arq claims it and the reply is {payload, try, runnable}:
# runnable = 1 when no abort was asked and the record was queued (or running under a lost worker),
# and the record now says running here.
_TAKE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then return false end
redis.call('PSETEX', KEYS[2], ARGV[2], '1')
local payload = redis.call('GET', KEYS[4]) or ''
local try = redis.call('INCR', KEYS[5])
redis.call('EXPIRE', KEYS[5], ARGV[5])
local aborted = redis.call('ZREM', KEYS[6], ARGV[1])
local s = redis.call('HGET', KEYS[1], 'status')
if aborted == 1 or (s ~= 'queued' and s ~= 'running') then return {payload, try, 0} end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[3], 'started_at', ARGV[4])
return {payload, try, 1}
"""

# KEYS: job hash, the vanished worker's lease, its queue, the target queue, the job's in-progress key,
# the target's wake list; ARGV: job id, score. Move a job off a worker that vanished, unless its id is
# leased again (-1: a restarted worker resumes its jobs) or the job left the queue meanwhile (0). The
# record says queued on the target before the target is woken, in the same step (1), unless the job
# had already ended (2: its worker finished it just before vanishing; it is never revived, and the
# target only clears it away).
_MOVE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('DEL', KEYS[5])
local s = redis.call('HGET', KEYS[1], 'status')
local requeued = s == 'queued' or s == 'running'
if requeued then redis.call('HSET', KEYS[1], 'status', 'queued', 'queue', KEYS[4]) end
redis.call('RPUSH', KEYS[6], ARGV[1])
if requeued then return 1 end
return 2
"""

# KEYS: job hash, done channel, then (a worker ending its job) the queue, the abort set and arq's keys
# for the job; ARGV: status, outcome JSON, ttl, job id, terminal statuses... The job leaves its queue
# whoever won; the outcome is stored and announced only by the first terminal write. The notice
# carries the outcome ("<job id> <outcome JSON>"), so a waiter needs no second read.
_FINISH = """
if #KEYS > 2 then
  redis.call('ZREM', KEYS[3], ARGV[4])
  redis.call('ZREM', KEYS[4], ARGV[4])
  redis.call('DEL', unpack(KEYS, 5))
end
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 0 end
for i = 5, #ARGV do if s == ARGV[i] then return 0 end end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'outcome', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('PUBLISH', KEYS[2], ARGV[4] .. ' ' .. ARGV[2])
return 1
"""


@dataclass(frozen=True)
class Taken:
    """A job a worker has claimed: its arq payload (empty once arq's copy expired), which try this
    is, and whether to run it (False: it ended or an abort was asked while it was queued)."""

    payload: bytes
    attempt: int
    runnable: bool


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
        self._take = redis.register_script(_TAKE)
        self._finish = redis.register_script(_FINISH)
        self._move = redis.register_script(_MOVE)

    def new_record(self, request_id: str, created_at: float, deadline_at: float) -> tuple[dict[str, str], int]:
        """The fields of a new queued job's record (its queue is added where it is placed), and
        its ttl: it lives until its deadline plus the result TTL."""
        fields = {
            "status": JobStatus.queued.value,
            "request_id": request_id,
            "created_at": repr(created_at),
            "deadline_at": repr(deadline_at),
        }
        return fields, int(deadline_at - created_at) + self.result_ttl

    async def take(self, job_id: str, queue: str, worker_id: str, in_progress_ms: int) -> Taken | None:
        """Claim the job for `worker_id`, who serves `queue`; None when it is not in that queue any
        more or another worker holds it."""
        reply = await self._take(
            keys=[keys.job_key(job_id), in_progress_key_prefix + job_id, queue, job_key_prefix + job_id,
                  retry_key_prefix + job_id, abort_jobs_ss],
            args=[job_id, in_progress_ms, worker_id, repr(time.time()), RETRY_KEY_TTL])
        if reply is None:
            return None
        payload, attempt, runnable = reply
        return Taken(payload=payload, attempt=int(attempt), runnable=bool(runnable))

    async def finish(self, job_id: str, outcome: JobOutcome, queue: str | None = None) -> bool:
        """Store the outcome unless the job already ended; True when this write won. A worker
        passes its `queue`: the job then leaves it, with arq's keys for it, in the same step."""
        cleanup = [] if queue is None else [queue, abort_jobs_ss, in_progress_key_prefix + job_id,
                                             retry_key_prefix + job_id, job_key_prefix + job_id]
        won = await self._finish(
            keys=[keys.job_key(job_id), keys.DONE_CHANNEL, *cleanup],
            args=[outcome.status.value, outcome.model_dump_json(), self.result_ttl, job_id, *_TERMINAL],
        )
        return bool(won)

    async def move(self, job_id: str, from_worker: str, to_queue: str, score: float) -> int:
        """Move the job from vanished worker `from_worker`'s queue to `to_queue` and wake its worker:
        1 moved and queued there, 2 moved but it had already ended, 0 no longer in the queue, -1 not
        moved because `from_worker`'s id is leased again (its restart resumes the job)."""
        return int(await self._move(
            keys=[keys.job_key(job_id), keys.lease_key(from_worker), keys.queue_name(from_worker), to_queue,
                  in_progress_key_prefix + job_id, keys.wake_key(to_queue)],
            args=[job_id, score]))

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
