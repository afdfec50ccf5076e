"""Routing and enqueueing in one step, inside Redis: one script reads the fleet (fresh heartbeats;
each worker's engine state, capacity and job time from its small routing hash; queue lengths),
picks the worker, checks that it can finish the job before its deadline, and writes the job
record, arq's job, the queue entry and the worker's wake-up token. One round trip per submit, and
no two API replicas can route on the same stale queue lengths.

The rules are those of `common/routing.py` (the reference, also used by recovery), carried out in
Lua: rendezvous ranking by sha1(key NUL worker id), the bounded-load walk over jobs waiting for a
slot (⌈c·(total + 1)/n⌉), then admission by `WorkerInfo.expected_finish`. tests/test_dispatch.py
holds the two to the same choices."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from common import keys
from common.membership import LIVENESS_WINDOW
from common.settings import RoutingPolicy

# KEYS[1] workers zset. ARGV: 1 now (s), 2 liveness window (s), 3 routing hash prefix, 4 policy, 5 route key,
# 6 load factor, 7 seconds left before the deadline, 8 round robin counter key, 9 job id, 10 record key,
# 11 record ttl (s), 12 arq job key, 13 arq payload, 14 arq job ttl (ms), 15 queue score (ms), 16 wake key
# suffix, 17... record field/value pairs.
# Reply: {'ok', queue} | {'none'} (no worker with a fresh heartbeat and a healthy engine)
#      | {'overloaded', seconds until the soonest worker could finish it}.
_SUBMIT = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local workers, weight = {}, {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now - window, '+inf')) do
  local f = redis.call('HMGET', ARGV[3] .. id, 'queue', 'engine_ok', 'max_jobs', 'running', 'avg_job_seconds')
  if f[1] and f[2] == '1' then
    local w = {id = id, queue = f[1], max_jobs = tonumber(f[3]), running = tonumber(f[4]),
               avg_job_seconds = tonumber(f[5])}
    w.length = redis.call('ZCARD', w.queue)
    workers[#workers + 1] = w
    weight[id] = redis.sha1hex(ARGV[5] .. '\\0' .. id)
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
if ARGV[4] == 'round_robin' then
  local by_id = {}
  for i, w in ipairs(workers) do by_id[i] = w end
  table.sort(by_id, function(a, b) return a.id < b.id end)
  chosen = by_id[(redis.call('INCR', ARGV[8]) % #by_id) + 1]
else
  local waiting, total = {}, 0
  for _, w in ipairs(workers) do
    waiting[w.id] = math.max(0, w.length - w.max_jobs)
    total = total + waiting[w.id]
  end
  local bound = math.ceil(tonumber(ARGV[6]) * (total + 1) / #workers)
  for _, w in ipairs(ranked) do
    if waiting[w.id] + 1 <= bound then chosen = w break end
  end
end

local function expected_finish(w)
  local ahead = w.length + math.max(0, w.running - w.max_jobs + 1)
  return (ahead / w.max_jobs + 1) * w.avg_job_seconds
end
local remaining = tonumber(ARGV[7])
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

redis.call('HSET', ARGV[10], 'queue', target.queue, unpack(ARGV, 17))
redis.call('EXPIRE', ARGV[10], ARGV[11])
redis.call('PSETEX', ARGV[12], ARGV[14], ARGV[13])
redis.call('ZADD', target.queue, ARGV[15], ARGV[9])
redis.call('RPUSH', target.queue .. ARGV[16], ARGV[9])
return {'ok', target.queue}
"""


@dataclass(frozen=True)
class Placement:
    """Where a job went: `queue`, or nowhere (`no_worker`, or `soonest`: the seconds until the
    soonest worker could finish it, when none could before its deadline)."""

    queue: str | None = None
    no_worker: bool = False
    soonest: float | None = None


class Dispatcher:
    """Routes and enqueues jobs with one script call each."""

    def __init__(self, redis: Redis, load_factor: float, routing: RoutingPolicy) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, not {load_factor}")
        self.load_factor = load_factor
        self.routing = routing
        self._submit = redis.register_script(_SUBMIT)

    async def place(self, job_id: str, route_key: str, remaining: float, record_key: str,
                    record: dict[str, str], record_ttl: int, arq_key: str, arq_payload: bytes) -> Placement:
        """Route the job by `route_key` and, if some worker can finish it within `remaining`
        seconds, write `record` (plus its queue) and arq's job, queue it and wake its worker."""
        now = time.time()
        fields = [item for pair in record.items() for item in pair]
        reply = await self._submit(keys=[keys.WORKERS], args=[
            repr(now), LIVENESS_WINDOW, keys.route_info_key(""), self.routing.value, route_key,
            repr(self.load_factor),
            repr(remaining), keys.ROUND_ROBIN_TURN, job_id, record_key, record_ttl, arq_key, arq_payload,
            int((max(1.0, remaining) + 60) * 1000), int(now * 1000), keys.wake_key(""), *fields])
        verdict = reply[0]
        if verdict == b"ok":
            return Placement(queue=reply[1].decode())
        if verdict == b"none":
            return Placement(no_worker=True)
        return Placement(soonest=float(reply[1]))
