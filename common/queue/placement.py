"""Submission in one step, inside Redis: one script claims the client's idempotency key (if any, per
tenant), checks the tenant's limits (its jobs not yet ended, sync and async) and that Redis has room past
the jobs it holds (a headroom below its maxmemory, kept for their starts and ends; where tenants share
the queue, a band as wide below that is kept from a tenant holding more than its weight's share of the
async jobs in Redis, queued or kept with their outcomes), reads the fleet (fresh heartbeats; each
worker's engine state, capacity and job time from its small routing hash; queue lengths), picks the
worker, checks that it can finish the job before its deadline, writes the job record, arq's job and the
queue entry at the job's score, and wakes the worker (its queue's wake channel). One round trip per
submit; no two API replicas can route on the same stale queue lengths, and a key is never held by a job
that was not placed. Times are Redis's (TIME): the record's deadline is the one every worker obeys.

The score is the order jobs start in (the worker's claims take the lowest first, as arq's poll would,
worker/wakeups.py). Between tenants it is start-time fair queuing (Goyal et al. 1996) per worker queue:
the queue's virtual time is the fair start of the job it started last, and a tenant's clock in a lane,
never behind that virtual time, moves on by each job's prompts / the tenant's weight; so a tenant
with a backlog is interleaved with another tenant's newer jobs, in proportion to their weights, instead
of served first. Interactive jobs (sync requests, and async jobs that ask) go before batch work by
INTERACTIVE_LEAD_MS of fair time, which bounds how long batch work can be passed: a batch job waits
behind no interactive job whose fair start is that much later than its own, so with each tenant's
interactive clock moving on by every job it sends, batch work never starves.

The routing rules, carried out in Lua: rendezvous ranking by sha1(key NUL worker id) (common/routing.py's
`rank_workers`, which recovery uses), the bounded-load walk over jobs waiting for a slot
(⌈c·(total + 1)/n⌉), then admission by expected finish (an interactive job counts only the interactive
jobs queued ahead of it). Their Python reference is tests/routing_reference.py; tests/test_dispatch.py
holds the two to the same choices."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common.jobs import Lane
from common.queue import keys
from common.queue.arq_layout import ARQ_LUA
from common.queue.membership import LIVENESS_WINDOW
from common.queue.records import RECORD_LUA
from common.settings import RoutingPolicy
from common.tenants import DEFAULT_TENANT

log = logging.getLogger("openjev.queue")

FAIR_ORIGIN_MS = 10**15  # scores are fair starts (virtual ms from 0) less this: far below any clock's ms, so every
# queued job is due at once and the worker, which takes the lowest scores first, starts them in fair order (fair
# starts would need centuries of full load to reach it; a float holds them exactly up to 2**53)
INTERACTIVE_LEAD_MS = 30_000  # an interactive job is queued as if its fair start were this much earlier: it goes
# before batch work, but never before a batch job whose fair start is this much earlier than its own
PROMPT_COST_MS = 10  # how far a job moves its tenant's clock per engine prompt (warm call + branches), at weight 1

# KEYS[1] workers zset. ARGV: 1 liveness window (s), 2 routing hash prefix, 3 policy, 4 route key, 5 load
# factor, 6 seconds the job may take, 7 round robin counter key, 8 job id, 9 record key, 10 record ttl past
# the deadline (s), 11 arq payload (written by arq_layout.py's `arq_enqueue`), 12 idempotency key ('' for
# none), 13 its value's digest, 14 tenant, 15 clock ttl (s), 16 lane, 17 the job's fair cost (virtual ms,
# weighted), 18 max concurrent jobs (0: no limit), 19 max queued async jobs (0: no limit), 20 'async' or
# 'sync', 21 fair origin (ms), 22 interactive lead (ms), 23 headroom (the share of maxmemory kept; 0: none),
# 24 the crowding band below it (a share of maxmemory; 0: none, for a sync job or a queue of one tenant),
# 25 the tenant's weight, 26 the weights of all tenants sharing the queue, 27 ... record field/value pairs.
# Reply: {'ok', queue, created_at, deadline_at, 'noinfo' when INFO was refused or ''} | {'held',
#      "<job id>:<digest>"} (the idempotency key is taken) | {'limited', limit name, its value} (the tenant is
#      at a limit) | {'full'} (Redis is within the headroom of its maxmemory) | {'crowding', the tenant's async
#      jobs in Redis (queued, or ended and kept), all tenants'} (Redis is within the headroom and the band, and the
#      tenant holds more than its weight's share) | {'none'} (no worker with a fresh heartbeat and a healthy
#      engine) | {'overloaded', seconds until the soonest worker could finish it}.
_SUBMIT = ARQ_LUA + RECORD_LUA + """
if ARGV[12] ~= '' then
  local held = redis.call('GET', ARGV[12])
  if held then return {'held', held} end
end
local t = redis.call('TIME')
local now, window = t[1] + t[2] / 1e6, tonumber(ARGV[1])
local interactive = ARGV[16] == 'interactive'

-- Nothing is written until the job is placed, and the first write is one that Redis refuses at its maxmemory
-- (INCR, SET, HSET, ZADD; not ZREMRANGEBYSCORE or EXPIRE): Redis refuses a script at its first such write
-- unless it has written before, and then lets it finish past the limit. So a full Redis refuses the whole
-- placement (the API's 503) instead of taking a job no worker could claim.
local tenant_jobs, tenant_async = 'TENANT_PREFIX' .. ARGV[14] .. ':jobs', 'TENANT_PREFIX' .. ARGV[14] .. ':async'
local max_jobs, max_queued = tonumber(ARGV[18]), tonumber(ARGV[19])
if max_jobs > 0 and redis.call('ZCOUNT', tenant_jobs, '(' .. now, '+inf') >= max_jobs then
  return {'limited', 'max_concurrent_jobs', max_jobs}
end
local queued  -- the tenant's async jobs not yet ended, counted once for its limit and the band
local function queued_async()
  queued = queued or redis.call('ZCOUNT', tenant_async, '(' .. now, '+inf')
  return queued
end
if ARGV[20] == 'async' and max_queued > 0 and queued_async() >= max_queued then
  return {'limited', 'max_queued_jobs', max_queued}
end

-- Room for the jobs already taken. A Redis at its maxmemory (noeviction) refuses the writes a queued job needs
-- to start and to end (arq's count of its tries, the claim, the outcome), so none would run until keys expire
-- or the limit is raised: placements stop the headroom's share of maxmemory short of it. A sync job may use
-- half of that share: its caller waits for it and its record goes 15 s after it ends, so sync jobs hold what
-- their callers' pace brings rather than a backlog, and a tenant's async jobs, which can fill Redis, do not
-- shut every sync caller out; the other half stays the workers'.
-- Below that, where tenants share the queue, a band (ARGV[24], the headroom again) is kept from the tenants
-- crowding the others out: there an async job of a tenant that holds more than its weight's share of all
-- tenants' async jobs in Redis (its weight over all of theirs) is refused, so one tenant's flood (even one alone so
-- far) stops short of it and leaves room for the others', and tenants that all send keep their shares. A tenant's
-- async jobs in Redis are those queued or running and those ended whose records are kept for their readers
-- (records.py), which is where most of the memory goes once the queue is short.
-- A Redis whose ACL refuses INFO (a managed one's may) places without it, and says so in its reply.
local headroom, memory = tonumber(ARGV[23]), nil
if ARGV[20] == 'sync' then headroom = headroom / 2 end
if headroom > 0 then
  memory = redis.pcall('INFO', 'memory')
  if type(memory) == 'string' then
    local limit = tonumber(string.match(memory, '\\nmaxmemory:(%d+)'))
    local used = tonumber(string.match(memory, '\\nused_memory:(%d+)'))
    if limit and limit > 0 then
      if used > limit * (1 - headroom) then return {'full'} end
      if used > limit * (1 - headroom - tonumber(ARGV[24])) then
        local mine = queued_async() + redis.call('ZCOUNT', 'TENANT_PREFIX' .. ARGV[14] .. ':kept', '(' .. now, '+inf')
        local all = redis.call('ZCOUNT', 'ASYNC_JOBS', '(' .. now, '+inf')
        if mine * tonumber(ARGV[26]) > tonumber(ARGV[25]) * all then return {'crowding', mine, all} end
      end
    end
  end
end

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

-- Start-time fair queuing on a worker's queue: its virtual time is the fair start of the job it started last
-- (records.py `record_start`); a tenant's clock in a lane says where its next job starts, never behind the queue's
-- virtual time, and each job moves it on by its cost. The job's score there is its fair start (an interactive one's
-- less the lead), and it waits behind the jobs queued at lower scores alone: another tenant's backlog, queued
-- after it in fair order, does not count (running jobs are among the lower scores until they end).
-- Each worker's is read once (its expected finish is asked once) and kept on it for the target's placement.
local function expected_finish(w)
  w.clock = w.queue .. ':clock:' .. ARGV[16] .. ':' .. ARGV[14]
  local clocks = redis.call('MGET', w.queue .. ':vclock', w.clock)
  w.start = math.max(tonumber(clocks[1] or 0), tonumber(clocks[2] or 0))
  w.score = w.start - tonumber(ARGV[21]) - (interactive and tonumber(ARGV[22]) or 0)
  local lower = 0  -- none waits when the queue holds no more than the jobs running
  if w.length > w.running then lower = redis.call('ZCOUNT', w.queue, '-inf', string.format('(%.17g', w.score)) end
  local waiting = math.max(0, lower - w.running)
  local ahead = waiting + math.max(0, w.running - w.max_jobs + 1)
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
local start, score = target.start, target.score
redis.call('SET', target.clock, tostring(start + tonumber(ARGV[17])), 'EX', ARGV[15])

local deadline = now + remaining
local ttl = math.ceil(remaining) + tonumber(ARGV[10])
local arq_id = ARGV[8] .. '.1'
-- An async job is in its tenant's count of queued async jobs and, where tenants share the queue (the band is on),
-- in all tenants' count, which its record says ('counted'), so that only such a job is moved in it as it ends (to
-- stay there while its record is kept, records.py).
local counted = {}
if ARGV[20] == 'async' then
  counted = {tenant_async}
  if tonumber(ARGV[24]) > 0 then counted[2] = 'ASYNC_JOBS' end
end
local fields = {'queue', target.queue, 'placement', arq_id, 'placements', 1, 'fair_start', tostring(start),
                'lane', ARGV[16], 'created_at', tostring(now), 'deadline_at', tostring(deadline)}
if counted[2] then fields[#fields + 1] = 'counted' fields[#fields + 1] = '1' end
for i = 27, #ARGV do fields[#fields + 1] = ARGV[i] end
record_placed(ARGV[9], ttl, fields)
arq_enqueue(target.queue, arq_id, ARGV[11], ttl * 1000, score, now)
-- The tenant's jobs not yet ended (their deadlines are their scores; an ended job's entry goes as it ends,
-- records.py, or here once its deadline has passed).
redis.call('ZREMRANGEBYSCORE', tenant_jobs, '-inf', now)
redis.call('ZADD', tenant_jobs, deadline, ARGV[8])
for _, key in ipairs(counted) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, deadline, ARGV[8])
end
-- These sets outlive every member's deadline; their expiry moves BOUND_SLACK s further than this job needs, so
-- the jobs that follow within that time find it far enough and leave it (one TTL each, no EXPIRE).
for _, key in ipairs({tenant_jobs, unpack(counted)}) do
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl + BOUND_SLACK) end
end
if ARGV[12] ~= '' then redis.call('SET', ARGV[12], ARGV[8] .. ':' .. ARGV[13], 'EX', ttl) end
return {'ok', target.queue, tostring(now), tostring(deadline), (memory and type(memory) ~= 'string') and 'noinfo' or ''}
""".replace("TENANT_PREFIX", keys.TENANT_PREFIX).replace("BOUND_SLACK", str(keys.BOUND_SLACK)).replace(
    "ASYNC_JOBS", keys.ASYNC_JOBS)


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
    full: bool = False  # Redis is within the headroom of its maxmemory
    crowding: tuple[int, int] | None = None  # tenants share the queue, Redis is within twice the headroom, and
    # the tenant holds more than its weight's share of the async jobs in Redis (queued, or ended and kept): (its,
    # all tenants')
    limited: tuple[str, int] | None = None  # the tenant's limit it is at: (its name, its value)


@dataclass(frozen=True)
class RedisMemory:
    """Redis's memory as INFO reports it: `used`, `limit` (its maxmemory; 0: none), `admission`, past which
    async placements stop (the limit less the headroom; 0 with no limit; sync ones may use half the headroom),
    and `crowding`, past which a tenant holding more than its weight's share of the async jobs in Redis (queued,
    or ended and kept) places none (the limit less twice the headroom; None where the queue is one tenant's,
    which has no such band)."""

    used: int
    limit: int
    admission: int
    crowding: int | None


@dataclass(frozen=True)
class Admission:
    """Whose job it is and how it queues: the tenant (its limits and weight) and the lane."""

    tenant: str = DEFAULT_TENANT
    lane: Lane = Lane.batch
    sync: bool = False  # a sync request's job (its caller waits) rather than an async job
    prompts: int = 1  # engine prompts the job sends (warm call + branches): its cost in fair queuing
    weight: float = 1.0  # the tenant's share against other tenants'
    max_concurrent_jobs: int | None = None  # the tenant's jobs not yet ended, sync and async
    max_queued_jobs: int | None = None  # the tenant's async jobs not yet ended
    shared_weight: float = 0.0  # the weights of all the tenants that may queue jobs (this one's included), where
    # there are several (0: the queue is this tenant's alone): within twice the headroom of Redis's maxmemory, a
    # tenant holding more than its share of the async jobs in Redis, queued or kept (weight / shared_weight), places
    # none

    @property
    def shared(self) -> bool:
        return self.shared_weight > 0

    @property
    def fair_cost_ms(self) -> float:
        return self.prompts * PROMPT_COST_MS / self.weight


@dataclass(frozen=True)
class IdempotencyClaim:
    """A client's `Idempotency-Key` and the digest of the body submitted under it."""

    key: str
    digest: str


class Dispatcher:
    """Routes and enqueues jobs with one script call each."""

    def __init__(self, redis: Redis, load_factor: float, routing: RoutingPolicy, headroom: float = 0.0) -> None:
        """`headroom`: the share of Redis's maxmemory that placements leave to the jobs already placed (0:
        place until Redis refuses)."""
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, not {load_factor}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be at least 0 and below 1, not {headroom}")
        self.load_factor = load_factor
        self.routing = routing
        self.headroom = headroom
        self.redis = redis
        self._submit = redis.register_script(_SUBMIT)

    async def memory(self, shared: bool) -> RedisMemory | None:
        """Redis's memory and where placements stop (`shared`: tenants share the queue, so it has a crowding
        band); None when its ACL refuses INFO."""
        try:
            info = await self.redis.info("memory")
        except ResponseError:
            return None
        limit = int(info.get("maxmemory", 0))
        return RedisMemory(used=int(info["used_memory"]), limit=limit, admission=int(limit * (1 - self.headroom)),
                           crowding=int(limit * max(0.0, 1 - 2 * self.headroom)) if shared else None)

    async def place(self, job_id: str, route_key: str, remaining: float, record: dict[str, str],
                    keep_after_deadline: int, arq_payload: bytes,
                    idempotency: IdempotencyClaim | None = None, admission: Admission = Admission()) -> Placement:
        """Route the job by `route_key` and, if its tenant is within its limits and some worker can
        finish it within `remaining` seconds, write `record` (plus its queue, placement, times and
        tenant), which lives until `keep_after_deadline` seconds past the deadline, and arq's job, and
        queue it in its lane at its fair start. With `idempotency`, nothing is placed when the tenant's
        key is already held; otherwise it is claimed."""
        fields = [item for pair in {**record, "tenant": admission.tenant}.items() for item in pair]
        tenant = admission.tenant
        reply = await self._submit(keys=[keys.WORKERS], args=[
            LIVENESS_WINDOW, keys.route_info_key(""), self.routing.value, route_key, repr(self.load_factor),
            repr(remaining), keys.ROUND_ROBIN_TURN, job_id, keys.job_key(job_id), keep_after_deadline,
            arq_payload, keys.idempotency_key(tenant, idempotency.key) if idempotency else "",
            idempotency.digest if idempotency else "", tenant, keys.CLOCK_TTL, admission.lane.value,
            repr(admission.fair_cost_ms), admission.max_concurrent_jobs or 0, admission.max_queued_jobs or 0,
            "sync" if admission.sync else "async", FAIR_ORIGIN_MS, INTERACTIVE_LEAD_MS, repr(self.headroom),
            repr(self.headroom if admission.shared and not admission.sync else 0.0), repr(admission.weight),
            repr(admission.shared_weight), *fields])
        verdict = reply[0]
        if verdict == b"ok":
            if reply[4] == b"noinfo":
                self.headroom = 0.0  # not asked again
                log.warning("Redis refuses INFO (its ACL): placements no longer keep OPENJEV_REDIS_HEADROOM below its "
                            "maxmemory, and a Redis filled to it starts no queued job until keys expire")
            return Placement(queue=reply[1].decode(), created_at=float(reply[2]), deadline_at=float(reply[3]))
        if verdict == b"held":
            return Placement(held=reply[1].decode())
        if verdict == b"limited":
            return Placement(limited=(reply[1].decode(), int(reply[2])))
        if verdict == b"none":
            return Placement(no_worker=True)
        if verdict == b"full":
            return Placement(full=True)
        if verdict == b"crowding":
            return Placement(crowding=(int(reply[1]), int(reply[2])))
        return Placement(soonest=float(reply[1]))
