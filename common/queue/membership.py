"""Worker membership: each worker heartbeats its description into Redis, stamped with Redis's clock;
the API routes only to workers whose heartbeat is fresh."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import orjson
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from common.queue import keys

HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats while the worker evaluates jobs (its load changes)
RESTING_HEARTBEAT_INTERVAL = 2.0  # seconds between heartbeats with no job running: a beat can still be 3 s late
LIVENESS_WINDOW = 5.0  # a worker silent this long leaves the routing set
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # prompts per branch engine call, for the batching histogram


class CallTokens(Protocol):
    """One engine call's token figures (the worker's `GenerateResult`)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int | None: ...


class WorkerCounters(BaseModel):
    """Running totals since the worker started, published with every heartbeat: the per-worker
    prefix-cache hit ratio is `branch_cached_tokens / branch_prompt_tokens`."""

    jobs_done: int = 0  # jobs answered
    jobs_failed: int = 0  # jobs it ran that ended in an engine error, an abort or a timeout
    warm_calls: int = 0  # warm calls of answered jobs
    warm_prompt_tokens: int = 0  # their prompt tokens
    warm_cached_tokens: int = 0  # of those, the tokens the engine found in its prefix cache
    branch_calls: int = 0  # branches (one prompt each) of answered jobs
    branch_prompt_tokens: int = 0
    branch_cached_tokens: int = 0
    unreported_calls: int = 0  # calls whose engine did not report cached_tokens (SGLang 0.5.19's Rust frontend)
    engine_errors: int = 0  # engine calls that failed or were aborted by the engine
    jobs_rerun: int = 0  # jobs queued to run again after their engine failed them (common/queue/reruns.py)
    aborts_sent: int = 0  # abort requests sent for live calls of failed, timed-out or cancelled jobs
    branch_engine_calls: int = 0  # the batched engine calls that carried those branches
    branch_call_prompts: dict[str, int] = Field(default_factory=dict)  # those calls by prompts per call: the
    # smallest of BATCH_BUCKETS (as a string, or "+Inf") that holds the call's size -> calls
    endings: dict[str, int] = Field(default_factory=dict)  # outcomes this worker stored, by status, and
    # "refused": outcomes it computed for a job that had ended or moved meanwhile

    def record_ending(self, ending: str) -> None:
        """Count one job this worker ended (or whose ending was refused), where it happened."""
        self.endings[ending] = self.endings.get(ending, 0) + 1

    def record_job(self, warm: CallTokens, branches: Sequence[CallTokens], call_sizes: Sequence[int] = ()) -> None:
        """Add an answered job's warm call and branches; `call_sizes`: the prompts of each engine call
        that carried its branches."""
        for size in call_sizes:
            bucket = next((str(b) for b in BATCH_BUCKETS if size <= b), "+Inf")
            self.branch_call_prompts[bucket] = self.branch_call_prompts.get(bucket, 0) + 1
        self.branch_engine_calls += len(call_sizes)
        self.jobs_done += 1
        self.warm_calls += 1
        self.warm_prompt_tokens += warm.prompt_tokens
        self.warm_cached_tokens += warm.cached_tokens or 0
        self.branch_calls += len(branches)
        self.branch_prompt_tokens += sum(b.prompt_tokens for b in branches)
        self.branch_cached_tokens += sum(b.cached_tokens or 0 for b in branches)
        self.unreported_calls += sum(c.cached_tokens is None for c in (warm, *branches))

    @property
    def branch_hit_ratio(self) -> float | None:
        """Cached / prompt tokens over branch calls; None before any, or when the engine does not report hits."""
        return _ratio(self.branch_cached_tokens, self.branch_prompt_tokens, self.unreported_calls)

    @property
    def warm_hit_ratio(self) -> float | None:
        """Cached / prompt tokens over warm calls: how often a state's prefix was already on this worker."""
        return _ratio(self.warm_cached_tokens, self.warm_prompt_tokens, self.unreported_calls)


def _ratio(cached: int, prompt: int, unreported: int) -> float | None:
    return None if unreported or not prompt else cached / prompt


class WorkerInfo(BaseModel):
    """What a worker announces about itself."""

    id: str
    queue: str
    model: str
    max_jobs: int
    max_branches: int
    engine_ok: bool = True
    running: int = 0  # jobs being evaluated now
    avg_job_seconds: float = 0.0  # moving average of recent jobs' evaluation time (0 = no data yet)
    started_at: float
    heartbeat_at: float = 0.0
    counters: WorkerCounters = Field(default_factory=WorkerCounters)


# The heartbeat, as the start of a script: `heartbeat` below ends it there, the worker's beat
# (common/queue/leases.py) goes on with its lease's renewal. KEYS[1..3]: worker key, routing hash, workers
# zset; ARGV[1..4]: worker JSON, ttl (s), worker id, the routing hash's field/value pairs as one JSON array.
# Leaves Redis's time in `now`: the heartbeat's time is Redis's, so no host's clock decides liveness.
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], unpack(cjson.decode(ARGV[4])))
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], now, ARGV[3])
"""
_HEARTBEAT = HEARTBEAT_LUA + "return 1\n"

# KEYS[1] workers zset; ARGV: liveness window (s), worker key prefix, queue key prefix. Returns
# [Redis time, then worker JSON, heartbeat time, queue length, ... for each fresh heartbeat].
_FLEET = """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
local out = {tostring(now)}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now - ARGV[1], '+inf')) do
  local raw = redis.call('GET', ARGV[2] .. id)
  if raw then
    out[#out + 1] = raw
    out[#out + 1] = redis.call('ZSCORE', KEYS[1], id)
    out[#out + 1] = redis.call('ZCARD', ARGV[3] .. id)
  end
end
return out
"""

# KEYS[1] workers zset; ARGV: liveness window (s). Ids of members silent past the window.
_SILENT = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (t[1] + t[2] / 1e6 - ARGV[1]))
"""


async def heartbeat(redis: Redis, info: WorkerInfo) -> None:
    """Announce `info` as live now (by Redis's clock)."""
    heartbeat_keys, heartbeat_args = heartbeat_arguments(info)
    await redis.register_script(_HEARTBEAT)(keys=heartbeat_keys, args=heartbeat_args)


def heartbeat_arguments(info: WorkerInfo) -> tuple[list[str], list[str | int]]:
    """HEARTBEAT_LUA's KEYS and ARGV for `info`, stamped now."""
    info.heartbeat_at = time.time()
    routing = {"queue": info.queue, "engine_ok": str(int(info.engine_ok)), "max_jobs": str(info.max_jobs),
               "running": str(info.running), "avg_job_seconds": repr(info.avg_job_seconds)}
    return ([keys.worker_key(info.id), keys.route_info_key(info.id), keys.WORKERS],
            [info.model_dump_json(), int(LIVENESS_WINDOW * 2), info.id,
             orjson.dumps([item for pair in routing.items() for item in pair]).decode()])


async def leave(redis: Redis, worker_id: str, keep_membership: bool = False) -> None:
    """Stop receiving jobs at once (clean shutdown). With `keep_membership` the worker stays in the
    set as a silent member, so once its lease lapses its queued jobs are moved to live workers."""
    async with redis.pipeline(transaction=True) as pipe:
        if not keep_membership:
            pipe.zrem(keys.WORKERS, worker_id)
        pipe.delete(keys.worker_key(worker_id), keys.route_info_key(worker_id))
        await pipe.execute()


async def forget_member(redis: Redis, worker_id: str) -> None:
    """Drop a vanished worker from the set once nothing of it is left to move."""
    await redis.zrem(keys.WORKERS, worker_id)


async def fleet(redis: Redis) -> list[tuple[WorkerInfo, int]]:
    """Every worker with a fresh heartbeat (healthy engine or not) and its queue length, in one round
    trip. `heartbeat_at` is given on this host's clock: now less the heartbeat's age by Redis's."""
    flat = await redis.register_script(_FLEET)(keys=[keys.WORKERS], args=[LIVENESS_WINDOW, keys.worker_key(""),
                                                                          keys.queue_name("")])
    redis_now, local_now = float(flat[0]), time.time()
    members = []
    for i in range(1, len(flat), 3):
        info = WorkerInfo.model_validate(orjson.loads(flat[i]))
        info.heartbeat_at = local_now - (redis_now - float(flat[i + 1]))
        members.append((info, int(flat[i + 2])))
    return members


# KEYS: each queue's waiting set; ARGV[1] the longest a job can wait (s): older entries (a job that ended
# by a path that left no trace) are dropped. Reply: {Redis time, then per queue: count, oldest placement time}.
_BACKLOG = """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
local out = {tostring(now)}
for _, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - tonumber(ARGV[1]))
  local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  out[#out + 1] = redis.call('ZCARD', key)
  out[#out + 1] = oldest[2] or ''
end
return out
"""


@dataclass(frozen=True)
class Backlog:
    """Jobs queued on one worker that no worker has started yet."""

    waiting: int
    oldest_seconds: float  # how long the oldest of them has waited (0 when none)


class BacklogReader:
    """Reads each queue's waiting jobs (not arq's queue length, which counts running jobs too) in one call."""

    def __init__(self, redis: Redis, longest_job_seconds: float) -> None:
        self._backlog = redis.register_script(_BACKLOG)
        self.keep_seconds = longest_job_seconds + 60

    async def read(self, queues: list[str]) -> dict[str, Backlog]:
        if not queues:
            return {}
        flat = await self._backlog(keys=[keys.waiting_key(q) for q in queues], args=[self.keep_seconds])
        now = float(flat[0])
        return {queue: Backlog(int(flat[1 + 2 * i]), now - float(flat[2 + 2 * i]) if flat[2 + 2 * i] else 0.0)
                for i, queue in enumerate(queues)}


async def live_workers(redis: Redis) -> list[WorkerInfo]:
    """Workers that heartbeat within the liveness window and report a healthy engine."""
    return [w for w, _ in await fleet(redis) if w.engine_ok]


async def silent_members(redis: Redis) -> list[str]:
    """Ids still in the set whose heartbeat is older than the liveness window (by Redis's clock)."""
    return [w.decode() for w in await redis.register_script(_SILENT)(keys=[keys.WORKERS], args=[LIVENESS_WINDOW])]

