"""Submission in one step, inside Redis: one script claims the client's idempotency key (if any),
reads the fleet (fresh heartbeats; each worker's engine state, capacity and job time from its
small routing hash; queue lengths), picks the worker, checks that it can finish the job before its
deadline, and writes the job record, arq's job and the queue entry, and wakes the worker (its
queue's wake channel). One round trip per submit; no
two API replicas can route on the same stale queue lengths, and a key is never held by a job that
was not placed. Times are Redis's (TIME): the record's deadline is the one every worker obeys.

The rules are those of `common/routing.py` (the reference, also used by recovery), carried out in
Lua: rendezvous ranking by sha1(key NUL worker id), the bounded-load walk over jobs waiting for a
slot (⌈c·(total + 1)/n⌉), then admission by `WorkerInfo.expected_finish`. tests/test_dispatch.py
holds the two to the same choices."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from common.queue import keys
from common.queue.membership import LIVENESS_WINDOW
from common.settings import RoutingPolicy

SKEW_ALLOWANCE_MS = 60_000  # queue scores are Redis's time less this: arq takes a job once its score is
# past on the worker's own clock, so a worker whose clock lags Redis's still sees new jobs as due

# KEYS[1] workers zset. ARGV: 1 liveness window (s), 2 routing hash prefix, 3 policy, 4 route key,
# 5 load factor, 6 seconds the job may take, 7 round robin counter key, 8 job id, 9 record key,
# 10 record ttl past the deadline (s), 11 arq job key prefix, 12 arq payload, 13 idempotency key ('' for
# none), 14 its value's digest, 15 queue score offset (ms), 16 ... record field/value pairs.
# Reply: {'ok', queue, created_at, deadline_at} | {'held', "<job id>:<digest>"} (the idempotency key is
#      taken) | {'none'} (no worker with a fresh heartbeat and a healthy engine)
#      | {'overloaded', seconds until the soonest worker could finish it}.
_SUBMIT = """
if ARGV[13] ~= '' then
  local held = redis.call('GET', ARGV[13])
  if held then return {'held', held} end
end
local t = redis.call('TIME')
local now, window = t[1] + t[2] / 1e6, tonumber(ARGV[1])
local workers, weight = {}, {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now - window, '+inf')) do
  local f = redis.call('HMGET', ARGV[2] .. id, 'queue', 'engine_ok', 'max_jobs', 'running', 'avg_job_seconds')
  if f[1] and f[2] == '1' then
    local w = {id = id, queue = f[1], max_jobs = tonumber(f[3]), running = tonumber(f[4]),
               avg_job_seconds = tonumber(f[5])}
    w.length = redis.call('ZCARD', w.queue)
    workers[#workers + 1] = w
    weight[id] = redis.sha1hex(ARGV[4] .. '\\0' .. id)
  end
end
if #workers == 0 then return {'none'} end
local ranked = {}
for i, w in ipairs(workers) do ranked[i] = w end
table.sort(ranked, function(a, b)
  if weight[a.id] ~= weight[b.id] then return weight[a.id] > weight[b.id] end
  return a.id > b.id
end)

local chosen
if ARGV[3] == 'round_robin' then
  local by_id = {}
  for i, w in ipairs(workers) do by_id[i] = w end
  table.sort(by_id, function(a, b) return a.id < b.id end)
  chosen = by_id[(redis.call('INCR', ARGV[7]) % #by_id) + 1]
else
  local waiting, total = {}, 0
  for _, w in ipairs(workers) do
    waiting[w.id] = math.max(0, w.length - w.max_jobs)
    total = total + waiting[w.id]
  end
  local bound = math.ceil(tonumber(ARGV[5]) * (total + 1) / #workers)
  for _, w in ipairs(ranked) do
    if waiting[w.id] + 1 <= bound then chosen = w break end
  end
end

local function expected_finish(w)
  local ahead = w.length + math.max(0, w.running - w.max_jobs + 1)
  return (ahead / w.max_jobs + 1) * w.avg_job_seconds
end
local remaining = tonumber(ARGV[6])
local target, soonest = nil, expected_finish(chosen)
if soonest <= remaining then target = chosen end
for _, w in ipairs(ranked) do
  if target then break end
  if w.id ~= chosen.id then
    local finish = expected_finish(w)
    if finish <= remaining then target = w end
    soonest = math.min(soonest, finish)
  end
end
if not target then return {'overloaded', tostring(soonest)} end

local deadline = now + remaining
local ttl = math.ceil(remaining) + tonumber(ARGV[10])
local arq_id = ARGV[8] .. '.1'
redis.call('HSET', ARGV[9], 'queue', target.queue, 'placement', arq_id, 'placements', 1,
           'created_at', tostring(now), 'deadline_at', tostring(deadline), unpack(ARGV, 16))
redis.call('EXPIRE', ARGV[9], ttl)
redis.call('SET', ARGV[11] .. arq_id, ARGV[12], 'EX', ttl)
redis.call('ZADD', target.queue, math.floor(now * 1000) - tonumber(ARGV[15]), arq_id)
redis.call('PUBLISH', target.queue .. 'WAKE_SUFFIX', 'job ' .. arq_id)
if ARGV[13] ~= '' then redis.call('SET', ARGV[13], ARGV[8] .. ':' .. ARGV[14], 'EX', ttl) end
return {'ok', target.queue, tostring(now), tostring(deadline)}
""".replace("WAKE_SUFFIX", keys.WAKE_SUFFIX)


@dataclass(frozen=True)
class Placement:
    """Where a job went: `queue` (with its record's times, by Redis's clock), or nowhere: `held` (the
    idempotency key already names "<job id>:<digest>"), `no_worker`, or `soonest` (the seconds until
    the soonest worker could finish it, when none could before its deadline)."""

    queue: str | None = None
    created_at: float = 0.0
    deadline_at: float = 0.0
    held: str | None = None
    no_worker: bool = False
    soonest: float | None = None


@dataclass(frozen=True)
class IdempotencyClaim:
    """A client's `Idempotency-Key` and the digest of the body submitted under it."""

    key: str
    digest: str


class Dispatcher:
    """Routes and enqueues jobs with one script call each."""

    def __init__(self, redis: Redis, load_factor: float, routing: RoutingPolicy) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, not {load_factor}")
        self.load_factor = load_factor
        self.routing = routing
        self._submit = redis.register_script(_SUBMIT)

    async def place(self, job_id: str, route_key: str, remaining: float, record: dict[str, str],
                    keep_after_deadline: int, arq_payload: bytes,
                    idempotency: IdempotencyClaim | None = None) -> Placement:
        """Route the job by `route_key` and, if some worker can finish it within `remaining`
        seconds, write `record` (plus its queue, placement and times), which lives until
        `keep_after_deadline` seconds past the deadline, and arq's job, and queue it. With
        `idempotency`, nothing is placed when the key is already held; otherwise it is claimed."""
        fields = [item for pair in record.items() for item in pair]
        reply = await self._submit(keys=[keys.WORKERS], args=[
            LIVENESS_WINDOW, keys.route_info_key(""), self.routing.value, route_key, repr(self.load_factor),
            repr(remaining), keys.ROUND_ROBIN_TURN, job_id, keys.job_key(job_id), keep_after_deadline,
            keys.ARQ_JOB, arq_payload, keys.idempotency_key(idempotency.key) if idempotency else "",
            idempotency.digest if idempotency else "", SKEW_ALLOWANCE_MS, *fields])
        verdict = reply[0]
        if verdict == b"ok":
            return Placement(queue=reply[1].decode(), created_at=float(reply[2]), deadline_at=float(reply[3]))
        if verdict == b"held":
            return Placement(held=reply[1].decode())
        if verdict == b"none":
            return Placement(no_worker=True)
        return Placement(soonest=float(reply[1]))
