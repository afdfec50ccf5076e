"""Worker membership: each worker heartbeats its description into Redis; the API routes only to
workers whose heartbeat is fresh."""

from __future__ import annotations

import time

import orjson
from pydantic import BaseModel
from redis.asyncio import Redis

from common import keys

HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats
LIVENESS_WINDOW = 5.0  # a worker silent this long leaves the routing set


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
        pipe.zadd(keys.WORKERS, {info.id: now})
        await pipe.execute()


async def leave(redis: Redis, worker_id: str) -> None:
    """Leave the routing set at once (clean shutdown)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.WORKERS, worker_id)
        pipe.delete(keys.worker_key(worker_id))
        await pipe.execute()


async def live_workers(redis: Redis, now: float | None = None) -> list[WorkerInfo]:
    """Workers that heartbeat within the liveness window and report a healthy engine."""
    now = time.time() if now is None else now
    ids = await redis.zrangebyscore(keys.WORKERS, now - LIVENESS_WINDOW, "+inf")
    if not ids:
        return []
    raws = await redis.mget([keys.worker_key(i.decode()) for i in ids])
    workers = [WorkerInfo.model_validate(orjson.loads(raw)) for raw in raws if raw]
    return [w for w in workers if w.engine_ok]
