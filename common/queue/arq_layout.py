"""arq's job layout, written in one place. Besides arq itself (its worker runs and finishes a job),
the queue writes arq's keys only through the Lua functions below, which the scripts that need them
include: claims.py's claim (`arq_claim`, the worker's claim in place of arq's; `arq_take_off` for a job
whose API is gone) and look (`arq_take_off`, the same), placement.py's submit (`arq_enqueue`), leases.py's
move (`arq_take_off`, `arq_enqueue`) and resume (`arq_release_claims`), reruns.py's rerun (`arq_payload`,
`arq_enqueue`) and records.py's cancel (`arq_abort`). They write what
arq's own `Worker.start_jobs`, `ArqRedis.enqueue_job` and `Job.abort` write (README, "What
happens to a request", says why the scripts cannot call them); arq is pinned exactly, and
tests/test_arq_surface.py checks that the installed release reads this layout.

Beside arq's keys, a queue has a set of ours that follows its placements: `<queue>:waiting` (when each
was queued: the backlog the API reports). `arq_enqueue` and `arq_take_off` keep it with the queue, a
placement leaves it as it is claimed (claims.py) or taken off, and every queue entry wakes its worker
(`<queue>` + keys.WAKE_SUFFIX). The lane needs no set: it is in the score (placement.py)."""

from __future__ import annotations

from common.queue import keys

ARQ_LUA = f"""
local ARQ_JOB, ARQ_IN_PROGRESS, ARQ_RETRY = '{keys.ARQ_JOB}', '{keys.ARQ_IN_PROGRESS}', '{keys.ARQ_RETRY}'
local ARQ_ABORTS = '{keys.ARQ_ABORTS}'

-- arq's job `id` (its `payload`, as the worker's job_deserializer reads it, for `ttl_ms`) at `score` in
-- `queue`, as enqueue_job writes it; queued since `since` (Redis's clock, s); then the queue's worker is woken.
local function arq_enqueue(queue, id, payload, ttl_ms, score, since)
  redis.call('SET', ARQ_JOB .. id, payload, 'PX', ttl_ms)
  redis.call('ZADD', queue, score, id)
  local waiting = queue .. ':waiting'
  redis.call('ZADD', waiting, since, id)
  -- The waiting set outlives every member's deadline; its expiry moves past what this placement needs, so the
  -- placements that follow within that time find it far enough and leave it (one PTTL).
  if redis.call('PTTL', waiting) < ttl_ms then redis.call('PEXPIRE', waiting, ttl_ms + {keys.BOUND_SLACK * 1000}) end
  redis.call('PUBLISH', queue .. '{keys.WAKE_SUFFIX}', 'job ' .. id .. ' ' .. score)
end

-- arq's claim of placement `id` on `queue` for worker `holder` (what arq's `Worker.start_jobs` checks and
-- writes, in one step): nothing (false) when another holder's in-progress claim is on it, it is no longer
-- queued, or it is not due by `now_ms` (a retry deferred); otherwise its in-progress claim, held `hold_ms`,
-- names `holder`, and the reply is its score. A claim of `holder`'s own is taken again: a worker process
-- claims only what it is not running, so one it holds already is a claim whose reply it lost.
local function arq_claim(queue, id, holder, now_ms, hold_ms)
  local claim = ARQ_IN_PROGRESS .. id
  local held = redis.call('GET', claim)
  if held and held ~= holder then return false end
  local score = redis.call('ZSCORE', queue, id)
  if not score or tonumber(score) > now_ms then return false end
  redis.call('SET', claim, holder, 'PX', hold_ms)
  return score
end

-- Placement `id` taken off `queue` with every arq key it has (job, in-progress claim, retry count), so
-- nothing of it is left for a worker to run or finish: nil when it is not queued there, otherwise what a
-- move needs to queue it again: {{score, payload (false if expired), ttl_ms, since (false if unknown)}}.
local function arq_take_off(queue, id)
  local score = redis.call('ZSCORE', queue, id)
  if not score then return nil end
  redis.call('ZREM', queue, id)
  local job = ARQ_JOB .. id
  local taken = {{score = score, payload = redis.call('GET', job), ttl_ms = redis.call('PTTL', job),
                  since = redis.call('ZSCORE', queue .. ':waiting', id)}}
  redis.call('ZREM', queue .. ':waiting', id)
  redis.call('DEL', job, ARQ_IN_PROGRESS .. id, ARQ_RETRY .. id)
  return taken
end

-- Placement `id`'s payload and the ms it has left (false, -2 once it expired); arq's keys stay as they are.
local function arq_payload(id)
  return redis.call('GET', ARQ_JOB .. id), redis.call('PTTL', ARQ_JOB .. id)
end

-- arq's abort mark for placement `id` at `now_ms`, as Job.abort writes it; marks older than `keep_ms`
-- (no job they name can still run) are trimmed.
local function arq_abort(id, now_ms, keep_ms)
  redis.call('ZADD', ARQ_ABORTS, now_ms, id)
  redis.call('ZREMRANGEBYSCORE', ARQ_ABORTS, '-inf', now_ms - keep_ms)
end

-- The in-progress claims on `queue`'s placements dropped, so arq runs them again now rather than once the
-- claims expire; returns how many there were.
local function arq_release_claims(queue)
  local n = 0
  for _, id in ipairs(redis.call('ZRANGE', queue, 0, -1)) do n = n + redis.call('DEL', ARQ_IN_PROGRESS .. id) end
  return n
end
"""
