"""The job status record in Redis, and every write of it: when the job is placed (`record_placed`, in
placement.py's script) or queued again (`record_requeued`, in leases.py's move and reruns.py's rerun), then
by the job's current owner (its start, `record_start` in claims.py's claim; its outcome, `store`) or by the
API (cancel, collect). Every write is a script
that checks the record first, so the first ending wins and a worker the job was taken from (moved
off it while it was paused) can neither start it nor store an outcome: the record names its current
placement, and only that placement's worker passes the check (fencing)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.jobs import JobOutcome, JobStatus
from common.logs import RepeatedFailure
from common.queue import keys
from common.queue.arq_layout import ARQ_LUA
from common.tenants import DEFAULT_TENANT

log = logging.getLogger("openjev.queue")

SYNC_KEEP = 60  # seconds a sync job's record outlives its deadline or its outcome: only its caller reads it
# Seconds a sync job's record is kept once its outcome went out in the notice: its caller already has it,
# and one that missed the notice reads the record at its next recheck (every second), well within this
# (a Sentinel failover took 2.2-2.5 s). The expiry replaces a DEL per request.
SYNC_ANSWERED_KEEP = 15
# The largest outcome a sync job's notice carries (bytes of JSON): every API process receives every
# notice, so a bigger one (hundreds of options on many questions) is announced bare and read back.
NOTICE_OUTCOME_MAX = 64 * 1024
STORE_RETRY_DELAY = 0.25  # seconds between tries of an outcome store while Redis is unreachable
STORE_RETRY_LOG_INTERVAL = 10.0  # seconds between a process's warnings that Redis still refuses outcomes

# The record's writes made from other modules' scripts, as Lua functions those scripts include (placement.py's
# submit, leases.py's move, reruns.py's rerun), so that every write of a job's record is written here.
RECORD_LUA = """
-- A job placed: its record `key`, made of `fields` (field/value pairs), kept `ttl` seconds.
local function record_placed(key, ttl, fields)
  redis.call('HSET', key, unpack(fields))
  redis.call('EXPIRE', key, ttl)
end

-- The job of record `key` queued again, on `queue`, as its next placement ("<job id>.<n>", returned): moved off
-- a vanished worker, or run again after its engine failed it. `extra`: more field/value pairs to set.
local function record_requeued(key, job_id, queue, extra)
  local placement = job_id .. '.' .. redis.call('HINCRBY', key, 'placements', 1)
  redis.call('HSET', key, 'status', 'queued', 'queue', queue, 'placement', placement, unpack(extra))
  return placement
end
"""

def _leave_tenant_counts(tenant: str, job_id: str, kind: str, counted: str, kept_ttl: str) -> str:
    """Lua: a job that ends leaves the counts of jobs not yet ended (`tenant`, `job_id`, `kind`, `counted`,
    `kept_ttl`: Lua expressions for the record's tenant field, the job id, the record's kind, its 'counted' field
    and the seconds its record is kept from now): its tenant's, and for an async job its tenant's count of queued
    async jobs. An async job its record says is counted among all tenants' (placement.py: where tenants share the
    queue) stays in that count, until its record expires, since Redis holds it with its outcome for its reader;
    and it joins its tenant's count of such kept jobs: the two are what a tenant's share of Redis is taken from
    near its maxmemory."""
    return f"""
if {tenant} then
  redis.call('ZREM', '{keys.TENANT_PREFIX}' .. {tenant} .. ':jobs', {job_id})
  if {kind} ~= 'sync' then redis.call('ZREM', '{keys.TENANT_PREFIX}' .. {tenant} .. ':async', {job_id}) end
end
if {counted} == '1' then
  local clock = redis.call('TIME')
  local kept_ttl = {kept_ttl}
  local expires = clock[1] + clock[2] / 1e6 + kept_ttl  -- as the record's own expiry
  local counts = {{'{keys.ASYNC_JOBS}'}}
  if {tenant} then
    counts[2] = '{keys.TENANT_PREFIX}' .. {tenant} .. ':kept'
    redis.call('ZREMRANGEBYSCORE', counts[2], '-inf', expires - kept_ttl)
  end
  for _, key in ipairs(counts) do
    redis.call('ZADD', key, expires, {job_id})
    if redis.call('TTL', key) < kept_ttl then redis.call('EXPIRE', key, kept_ttl + {keys.BOUND_SLACK}) end
  end
end"""


# Lua functions run by claims.py's scripts: a job's start when its placement is claimed (`record_start`), and the
# sweep of a queue's waiting placements whose jobs' readers are gone (`record_sweep_gone`). A sync job that has waited
# `unseen_before` seconds or more and whose API's presence has lapsed (common/queue/presence.py) is nobody's to
# answer: it ends as `gone_outcome` (cancelled, 503 for a reader alive after all), announced on channel `done` as a
# store announces a sync job's ("<job id> cancelled <outcome>"), and leaves its tenant's count (`ended_if_gone`).
#
# record_start(key, placement, worker, job_id, done, unseen_before, gone_outcome): the start of the job of record
# `key` by `placement` (its arq job id) on `worker` (the claim also takes the placement out of its queue's waiting
# set). Nothing (false) unless the record names this placement and the job has not ended; 'gone' for a job ended
# as above. Otherwise it is running here (its fair start is the queue's virtual time if later,
# common/queue/placement.py), its `attempts` (starts, anywhere) count one more, and the reply is {created_at,
# deadline_at, now, attempts} by Redis's clock. A running job is taken again only by its own placement (the worker
# that serves its queue restarted).
#
# record_sweep_gone(queue, done, unseen_before, oldest, gone_outcome, limit): up to `limit` of the placements
# waiting on `queue` since `unseen_before` seconds or more, and `oldest` seconds at most (a sync job's deadline: one
# waiting longer is an async job, which this would only read), whose jobs end as above, oldest first; returns them
# (the caller takes them off).
START_LUA = """
local function record_fields(key)
  return redis.call('HMGET', key, 'status', 'placement', 'created_at', 'deadline_at', 'queue', 'fair_start',
                    'attempts', 'kind', 'api', 'tenant', 'counted')
end

local function ended_if_gone(key, f, placement, job_id, done, now, unseen_before, gone_outcome)
  if f[8] ~= 'sync' or not f[9] or now - tonumber(f[3]) < unseen_before
      or redis.call('EXISTS', 'API_PREFIX' .. f[9]) == 1 then
    return false
  end
  redis.call('HSET', key, 'status', 'cancelled', 'outcome', gone_outcome, 'ended_by', placement)
  END_FOR_TENANT
  redis.call('EXPIRE', key, SYNC_ANSWERED_KEEP)
  redis.call('PUBLISH', done, job_id .. ' cancelled ' .. gone_outcome)
  return true
end

local function redis_now()
  local t = redis.call('TIME')
  return t[1] + t[2] / 1e6
end

local function record_start(key, placement, worker, job_id, done, unseen_before, gone_outcome)
  local f = record_fields(key)
  if f[2] ~= placement or (f[1] ~= 'queued' and f[1] ~= 'running') then return false end
  local now = redis_now()
  if ended_if_gone(key, f, placement, job_id, done, now, unseen_before, gone_outcome) then return 'gone' end
  local attempts = (tonumber(f[7]) or 0) + 1
  redis.call('HSET', key, 'status', 'running', 'worker', worker, 'started_at', tostring(now), 'attempts', attempts)
  if f[5] then
    local vclock = f[5] .. ':vclock'
    if f[6] and tonumber(f[6]) > tonumber(redis.call('GET', vclock) or 0) then
      redis.call('SET', vclock, f[6], 'EX', CLOCK_TTL)
    end
  end
  return {f[3], f[4], tostring(now), attempts}
end

local function record_sweep_gone(queue, done, unseen_before, oldest, gone_outcome, limit)
  local now, swept = redis_now(), {}
  for _, placement in ipairs(redis.call('ZRANGEBYSCORE', queue .. ':waiting', now - oldest, now - unseen_before,
                                        'LIMIT', 0, limit)) do
    local job_id = string.match(placement, '^(.*)%.%d+$')
    local key = 'JOB_PREFIX' .. job_id
    local f = record_fields(key)
    if f[2] == placement and f[1] == 'queued'
        and ended_if_gone(key, f, placement, job_id, done, now, unseen_before, gone_outcome) then
      swept[#swept + 1] = placement
    end
  end
  return swept
end
""".replace("CLOCK_TTL", str(keys.CLOCK_TTL)).replace("API_PREFIX", keys.api_key("")).replace(
    "JOB_PREFIX", keys.job_key("")).replace("SYNC_ANSWERED_KEEP", str(SYNC_ANSWERED_KEEP)).replace(
    "END_FOR_TENANT", _leave_tenant_counts("f[10]", "job_id", "f[8]", "f[11]", "0"))

# KEYS: record, done channel; ARGV: arq job id, status, outcome JSON, result ttl (s), job id. Stored only
# by the job's current placement and only once: 1 stored (also when a retried call finds its own earlier
# store), 0 refused (ended already, or moved). The notice is "<job id> <status>"; a sync job's also
# carries the outcome ("<job id> <status> <outcome JSON>") up to NOTICE_OUTCOME_MAX bytes: its one
# reader, the request waiting for it, then answers without reading the record back; the record stays
# the truth for a waiter that missed the notice, for SYNC_ANSWERED_KEEP seconds.
_STORE = """
local f = redis.call('HMGET', KEYS[1], 'status', 'placement', 'kind', 'ended_by', 'tenant', 'counted')
if f[4] == ARGV[1] then return 1 end
if f[2] ~= ARGV[1] or (f[1] ~= 'queued' and f[1] ~= 'running') then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'outcome', ARGV[3], 'ended_by', ARGV[1])
END_FOR_TENANT
if f[3] == 'sync' and #ARGV[3] <= NOTICE_OUTCOME_MAX then
  redis.call('EXPIRE', KEYS[1], SYNC_ANSWERED_KEEP)
  redis.call('PUBLISH', KEYS[2], ARGV[5] .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
else
  redis.call('EXPIRE', KEYS[1], f[3] == 'sync' and SYNC_KEEP or tonumber(ARGV[4]))
  redis.call('PUBLISH', KEYS[2], ARGV[5] .. ' ' .. ARGV[2])
end
return 1
""".replace("SYNC_ANSWERED_KEEP", str(SYNC_ANSWERED_KEEP)).replace("SYNC_KEEP", str(SYNC_KEEP)).replace(
    "NOTICE_OUTCOME_MAX", str(NOTICE_OUTCOME_MAX)).replace(
    "END_FOR_TENANT", _leave_tenant_counts("f[5]", "ARGV[5]", "f[3]", "f[6]", "tonumber(ARGV[4])"))

# KEYS: record, done channel; ARGV: job id, status, outcome JSON, result ttl (s), abort mark max age (ms),
# grace (s; -1: now). Ends a job that has not ended (only once its deadline is `grace` seconds past, unless
# grace is -1): an async job keeps the outcome for its reader, a sync job's record goes (its caller is the
# one ending it). A placement not yet started is taken off its queue; a running one gets an abort mark for arq
# (arq_layout.py) and its worker a wake-up saying so; marks older than any job can live are trimmed: the set
# holds only marks that can still matter.
_CANCEL = ARQ_LUA + """
local f = redis.call('HMGET', KEYS[1], 'status', 'placement', 'kind', 'deadline_at', 'queue', 'tenant', 'counted')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
if tonumber(ARGV[6]) >= 0 and now < tonumber(f[4]) + tonumber(ARGV[6]) then return 0 end
END_FOR_TENANT
if f[3] == 'sync' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'status', ARGV[2], 'outcome', ARGV[3])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
end
redis.call('PUBLISH', KEYS[2], ARGV[1] .. ' ' .. ARGV[2])
if f[1] == 'queued' and f[5] then
  -- Not started: its placement is taken off its queue with its arq keys, so nothing of it is left to claim and
  -- no job queued after it counts it as ahead (placement.py's admission).
  arq_take_off(f[5], f[2])
else
  arq_abort(f[2], math.floor(now * 1000), tonumber(ARGV[5]))
  if f[5] then redis.call('PUBLISH', f[5] .. 'WAKE_SUFFIX', 'abort ' .. f[2]) end
end
return 1
""".replace("WAKE_SUFFIX", keys.WAKE_SUFFIX).replace(
    "END_FOR_TENANT", _leave_tenant_counts("f[6]", "ARGV[1]", "f[3]", "f[7]", "tonumber(ARGV[4])"))

# KEYS[1] record. A sync job's outcome, read and removed in one step once it ended: {status, outcome}.
_COLLECT = """
local f = redis.call('HMGET', KEYS[1], 'status', 'outcome')
if not f[2] then return {f[1] or '', ''} end
redis.call('DEL', KEYS[1])
return f
"""


@dataclass(frozen=True)
class Started:
    """A job its placement's worker may run now: the seconds it waited and those left before its deadline,
    and how many times it has been started, this time included (engine failures and crashes re-run it)."""

    waited: float
    remaining: float
    attempts: int = 1


def started_from(reply: list[bytes] | None) -> Started | None:
    """What `record_start` (START_LUA) replied."""
    if reply is None:
        return None
    created_at, deadline_at, now = (float(v) for v in reply[:3])
    return Started(waited=now - created_at, remaining=deadline_at - now, attempts=int(reply[3]))


@dataclass(frozen=True)
class JobRecord:
    """A job as the API reports it (times by Redis's clock)."""

    id: str
    status: JobStatus
    created_at: float
    deadline_at: float
    outcome: JobOutcome | None
    tenant: str = DEFAULT_TENANT  # who submitted it: only they may read or cancel it
    attempts: int = 0  # times a worker started it (more than one after an engine failure or a crash)
    last_failure: str | None = None  # why the latest attempt that failed for the engine's sake was run again


class JobStore:
    """Reads and writes job status records; one instance per process, over a shared Redis client."""

    def __init__(self, redis: Redis, result_ttl: int, abort_mark_ttl: float = 3600.0) -> None:
        """`result_ttl`: seconds an async job's outcome is kept; `abort_mark_ttl`: the longest a job can
        live from submission to deadline (an abort mark is dropped a minute after that)."""
        self.redis = redis
        self.result_ttl = result_ttl
        self.longest_job_seconds = abort_mark_ttl
        self.abort_mark_ms = int((abort_mark_ttl + 60) * 1000)
        self._store = redis.register_script(_STORE)
        self._cancel = redis.register_script(_CANCEL)
        self._collect = redis.register_script(_COLLECT)
        # One for every job of the process: jobs that end together while Redis is down or full give one
        # warning between them, not one each.
        self._store_failures = RepeatedFailure(log, "storing a job's outcome", STORE_RETRY_LOG_INTERVAL)

    async def store(self, arq_job_id: str, outcome: JobOutcome, give_up_at: float) -> bool:
        """Store the outcome if `arq_job_id` is still the job's placement and it has not ended; True
        when stored. Retries while Redis is unreachable or full, until `give_up_at` (time.monotonic()),
        with a warning at the process's first failure and one every STORE_RETRY_LOG_INTERVAL after, whichever
        job it is."""
        job_id = keys.job_of(arq_job_id)
        args = [arq_job_id, outcome.status.value, outcome.model_dump_json(), self.result_ttl, job_id]
        while True:
            try:
                stored = bool(await self._store(keys=[keys.job_key(job_id), keys.DONE_CHANNEL], args=args))
            except (RedisError, OSError) as exc:
                if time.monotonic() >= give_up_at:
                    raise
                self._store_failures.failed(
                    exc, f"job {job_id} tries again every {STORE_RETRY_DELAY:g} s until its deadline")
                await asyncio.sleep(STORE_RETRY_DELAY)
                continue
            self._store_failures.succeeded()
            return stored

    async def placements(self, arq_job_ids: list[str]) -> list[bool]:
        """For each arq job id, whether it is still its job's placement."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for arq_job_id in arq_job_ids:
                pipe.hget(keys.job_key(keys.job_of(arq_job_id)), "placement")
            current = await pipe.execute()
        return [c is not None and c.decode() == a for a, c in zip(arq_job_ids, current, strict=True)]

    async def cancel(self, job_id: str, outcome: JobOutcome, after_deadline: float | None = None) -> bool:
        """End the job with `outcome` unless it already ended, and have arq abort its placement;
        True when this call ended it. With `after_deadline`, only once its deadline is that many
        seconds past (by Redis's clock). A sync job's record is removed instead of kept."""
        return bool(await self._cancel(
            keys=[keys.job_key(job_id), keys.DONE_CHANNEL],
            args=[job_id, outcome.status.value, outcome.model_dump_json(), self.result_ttl, self.abort_mark_ms,
                  -1 if after_deadline is None else after_deadline]))

    async def collect(self, job_id: str) -> tuple[JobStatus | None, JobOutcome | None]:
        """A sync job's status and, once it ended, its outcome, which is then removed from Redis."""
        status, outcome = await self._collect(keys=[keys.job_key(job_id)])
        if not status:
            return None, None
        return JobStatus(status.decode()), JobOutcome.model_validate_json(outcome) if outcome else None

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
        created_at=float(fields.get("created_at", 0.0)),
        deadline_at=float(fields.get("deadline_at", 0.0)),
        outcome=JobOutcome.model_validate(orjson.loads(outcome)) if outcome else None,
        tenant=fields.get("tenant", DEFAULT_TENANT),
        attempts=int(fields.get("attempts", 0)),
        last_failure=fields.get("last_failure"),
    )
