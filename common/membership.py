"""Worker membership: each worker heartbeats its description into Redis; the API routes only to
workers whose heartbeat is fresh."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import orjson
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from common import keys

HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats
LIVENESS_WINDOW = 5.0  # a worker silent this long leaves the routing set


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
    branch_calls: int = 0  # branch calls of answered jobs
    branch_prompt_tokens: int = 0
    branch_cached_tokens: int = 0
    unreported_calls: int = 0  # calls whose engine did not report cached_tokens (SGLang 0.5.19's Rust frontend)
    engine_errors: int = 0  # engine calls that failed or were aborted by the engine
    aborts_sent: int = 0  # abort requests sent for live calls of failed, timed-out or cancelled jobs

    def record_job(self, warm: CallTokens, branches: Sequence[CallTokens]) -> None:
        """Add an answered job's warm call and branch calls."""
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

    def expected_finish(self, queued: int) -> float:
        """Seconds a new job would take here: the queue ahead drains `max_jobs` at a time, then it runs."""
        ahead = queued + max(0, self.running - self.max_jobs + 1)
        return (ahead / self.max_jobs + 1) * self.avg_job_seconds


async def heartbeat(redis: Redis, info: WorkerInfo) -> None:
    """Announce `info` as live now."""
    now = time.time()
    info.heartbeat_at = now
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.worker_key(info.id), info.model_dump_json(), ex=int(LIVENESS_WINDOW * 2))
        pipe.hset(keys.route_info_key(info.id), mapping={
            "queue": info.queue, "engine_ok": int(info.engine_ok), "max_jobs": info.max_jobs,
            "running": info.running, "avg_job_seconds": repr(info.avg_job_seconds)})
        pipe.expire(keys.route_info_key(info.id), int(LIVENESS_WINDOW * 2))
        pipe.zadd(keys.WORKERS, {info.id: now})
        await pipe.execute()


async def leave(redis: Redis, worker_id: str, keep_membership: bool = False) -> None:
    """Stop receiving jobs at once (clean shutdown). With `keep_membership` the worker stays in the
    set as a silent member, so once its lease lapses its queued jobs are moved to live workers."""
    async with redis.pipeline(transaction=True) as pipe:
        if not keep_membership:
            pipe.zrem(keys.WORKERS, worker_id)
        pipe.delete(keys.worker_key(worker_id), keys.route_info_key(worker_id))
        await pipe.execute()


# KEYS[1] workers zset; ARGV: oldest live heartbeat, worker key prefix, queue key prefix.
# Returns [worker JSON, queue length, ...] for every worker with a fresh heartbeat, in one round trip.
_FLEET = """
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do
  local raw = redis.call('GET', ARGV[2] .. id)
  if raw then
    out[#out + 1] = raw
    out[#out + 1] = redis.call('ZCARD', ARGV[3] .. id)
  end
end
return out
"""


async def fleet(redis: Redis, now: float | None = None) -> list[tuple[WorkerInfo, int]]:
    """Every worker with a fresh heartbeat (healthy engine or not) and its queue length."""
    now = time.time() if now is None else now
    script = redis.register_script(_FLEET)
    flat = await script(keys=[keys.WORKERS],
                        args=[now - LIVENESS_WINDOW, keys.worker_key(""), keys.queue_name("")])
    return [(WorkerInfo.model_validate(orjson.loads(flat[i])), int(flat[i + 1])) for i in range(0, len(flat), 2)]


async def live_workers(redis: Redis, now: float | None = None) -> list[WorkerInfo]:
    """Workers that heartbeat within the liveness window and report a healthy engine."""
    now = time.time() if now is None else now
    ids = await redis.zrangebyscore(keys.WORKERS, now - LIVENESS_WINDOW, "+inf")
    if not ids:
        return []
    raws = await redis.mget([keys.worker_key(i.decode()) for i in ids])
    workers = [WorkerInfo.model_validate(orjson.loads(raw)) for raw in raws if raw]
    return [w for w in workers if w.engine_ok]
