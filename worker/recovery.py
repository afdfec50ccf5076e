"""Ownership and recovery of queues. A worker holds a lease on its worker id while it heartbeats;
only once a lease has lapsed may anyone touch that worker's jobs: a restarted worker with the same
id re-runs what it had in flight, and any live worker moves a vanished worker's jobs to the next
live worker in their prefix ranking. So a job never runs on two workers at once."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import orjson
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix, job_key_prefix

from common import keys
from common.jobstore import JobStore
from common.membership import LIVENESS_WINDOW, live_workers
from common.routing import rank_workers

log = logging.getLogger("openjev.worker")

# KEYS[1] lease; ARGV: token, ttl ms. Extend our own lease; 0 if someone else holds it.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == false then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') and 1 or 0 end
if v ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class LeaseLost(Exception):
    """Another process holds this worker id's lease: this one must stop serving its queue."""


class Lease:
    """The exclusive right to serve one worker id's queue, kept alive by `renew()`."""

    def __init__(self, redis: ArqRedis, worker_id: str) -> None:
        self.redis = redis
        self.key = keys.lease_key(worker_id)
        self.token = secrets.token_hex(8)
        self._renew = redis.register_script(_RENEW)

    async def acquire(self, patience: float = 4 * LIVENESS_WINDOW) -> None:
        """Wait until no other process holds the lease (a killed predecessor's lapses), then take it."""
        deadline = time.monotonic() + patience
        while not await self.redis.set(self.key, self.token, nx=True, px=int(LIVENESS_WINDOW * 1000)):
            if time.monotonic() > deadline:
                raise LeaseLost(f"{self.key} is still held by another process")
            await asyncio.sleep(0.25)

    async def renew(self) -> None:
        if not await self._renew(keys=[self.key], args=[self.token, int(LIVENESS_WINDOW * 1000)]):
            raise LeaseLost(f"{self.key} was taken by another process")

    async def release(self) -> None:
        if (await self.redis.get(self.key) or b"").decode() == self.token:
            await self.redis.delete(self.key)


async def resume_own_jobs(redis: ArqRedis, queue: str) -> int:
    """After taking the lease: jobs our predecessor had started become runnable again."""
    job_ids = [j.decode() for j in await redis.zrange(queue, 0, -1)]
    if not job_ids:
        return 0
    cleared = await redis.delete(*(in_progress_key_prefix + j for j in job_ids))
    if cleared:
        log.info("resuming %d job(s) interrupted on %s", cleared, queue)
    return int(cleared)


async def reap_vanished_workers(redis: ArqRedis, store: JobStore) -> int:
    """Move the jobs of workers whose lease lapsed to the next live worker in each job's ranking;
    returns how many jobs moved. Safe to run from every worker at once (a per-victim lock)."""
    now = time.time()
    stale = [w.decode() for w in await redis.zrangebyscore(keys.WORKERS, "-inf", now - LIVENESS_WINDOW)]
    if not stale:
        return 0
    live = await live_workers(redis, now)
    moved = 0
    for victim in stale:
        if await redis.exists(keys.lease_key(victim)):
            continue  # still owned (a restart is under way): its owner resumes the jobs
        if not await redis.set(keys.reap_lock_key(victim), b"1", nx=True, ex=30):
            continue
        moved += await _move_jobs(redis, store, victim, live)
    return moved


async def _move_jobs(redis: ArqRedis, store: JobStore, victim: str, live: list) -> int:
    queue = keys.queue_name(victim)
    entries = await redis.zrange(queue, 0, -1, withscores=True)
    if not live:
        return 0  # nowhere to go; they wait (or expire by their deadline)
    queues = {w.id: w.queue for w in live}
    moved = 0
    for raw_id, score in entries:
        job_id = raw_id.decode()
        target = queues[rank_workers(await _prefix_hash(redis, job_id), list(queues))[0]]
        result = await store.move(job_id, victim, target, score)
        if result == -1:
            log.info("worker %s is back; it resumes its remaining jobs", victim)
            return moved
        if result == 1:
            moved += 1
    await redis.zrem(keys.WORKERS, victim)
    if moved:
        log.warning("moved %d job(s) from vanished worker %s", moved, victim)
    return moved


async def _prefix_hash(redis: ArqRedis, job_id: str) -> str:
    raw = await redis.get(job_key_prefix + job_id)
    try:
        return str(orjson.loads(raw)["a"][0]["prefix_hash"])
    except (TypeError, KeyError, IndexError, orjson.JSONDecodeError):
        return job_id  # unreadable or gone: any live worker will do
