"""Ownership and recovery of queues. A worker holds a lease (a token that expires without renewal)
on its worker id; only once a lease has lapsed may anyone touch that worker's jobs: a restarted
worker with the same id re-runs what it had in flight, and any live worker moves a vanished
worker's jobs to the next live worker in their prefix ranking, each as a new placement (new arq
job id, new arq keys). A renewal never re-creates a lapsed lease: the worker learns that it lapsed
and fences itself (worker/fencing.py) before it takes a new one."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from redis.asyncio import Redis

from common.queue import keys
from common.queue.arq_layout import ARQ_LUA
from common.queue.membership import (
    HEARTBEAT_LUA,
    LIVENESS_WINDOW,
    WorkerInfo,
    forget_member,
    heartbeat_arguments,
    live_workers,
    silent_members,
)
from common.queue.records import RECORD_LUA
from common.routing import rank_workers

log = logging.getLogger("openjev.queue")

LEASE_TTL_MS = int(LIVENESS_WINDOW * 1000)

# A worker's beat: its heartbeat (membership's HEARTBEAT_LUA: KEYS[1..3], ARGV[1..4]), its lease's renewal
# and a look for silent members, in one script. KEYS[4] the lease; ARGV[5] token, ARGV[6] ttl (ms),
# ARGV[7] liveness window (s). Returns {held, ids of members silent past the window}; held is 1 when the
# lease was extended, 0 when it lapsed (nobody holds it: a renewal never re-creates it), -1 when another
# token holds it.
_BEAT = HEARTBEAT_LUA + """
local held = 1
local holder = redis.call('GET', KEYS[4])
if holder == false then held = 0
elseif holder ~= ARGV[5] then held = -1
else redis.call('PEXPIRE', KEYS[4], ARGV[6]) end
return {held, redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - ARGV[7]))}
"""

# KEYS[1] lease; ARGV[1] token. Drops the lease only while this token holds it (a lapsed lease may
# already be another process's by the time its old holder lets go).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: record, the vanished worker's lease, its queue, the target queue; ARGV: arq job id, job id. Moves one
# placement off a worker whose lease lapsed: -1 not moved (the id is leased again: its restart resumes the
# job), 0 no longer in that queue, 2 dropped (the job had ended, was moved before, or its payload expired:
# nothing to run), 1 moved as the job's next placement, queued on the target with a copy of the payload, in
# its lane and at its place in line (arq_layout.py). The old placement's arq keys go, so nothing of it is
# left for the vanished worker to run or finish.
_MOVE = ARQ_LUA + RECORD_LUA + """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local old = arq_take_off(KEYS[3], ARGV[1])
if not old then return 0 end
local f = redis.call('HMGET', KEYS[1], 'status', 'placement', 'created_at')
if not old.payload or old.ttl_ms <= 0 or f[2] ~= ARGV[1] or (f[1] ~= 'queued' and f[1] ~= 'running') then return 2 end
local new = record_requeued(KEYS[1], ARGV[2], KEYS[4], {})
arq_enqueue(KEYS[4], new, old.payload, old.ttl_ms, old.score, old.since or f[3])
return 1
"""

# KEYS[1] queue. After taking the lease: the predecessor's claims on the queue's jobs are cleared, so arq
# runs them again now rather than when the claims expire.
_RESUME = ARQ_LUA + """
return arq_release_claims(KEYS[1])
"""


class LeaseLapsed(Exception):
    """This worker's lease expired (it was paused or cut off): its jobs may have been moved."""


class LeaseTaken(Exception):
    """Another process holds this worker id's lease: this one must stop serving its queue."""


class Lease:
    """The exclusive right to serve one worker id's queue, kept alive by the worker's `beat`."""

    def __init__(self, redis: Redis, worker_id: str) -> None:
        self.redis = redis
        self.key = keys.lease_key(worker_id)
        self.token = secrets.token_hex(8)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, patience: float = 4 * LIVENESS_WINDOW) -> None:
        """Wait until no other process holds the lease (a killed predecessor's lapses), then take
        it with a new token."""
        deadline = time.monotonic() + patience
        token = secrets.token_hex(8)
        while not await self.redis.set(self.key, token, nx=True, px=LEASE_TTL_MS):
            if time.monotonic() > deadline:
                raise LeaseTaken(f"{self.key} is still held by another process")
            await asyncio.sleep(0.25)
        self.token = token

    def check(self, held: int) -> None:
        """Raise what a beat's renewal answered: LeaseLapsed (0), LeaseTaken (-1); 1 is extended."""
        if held == 0:
            raise LeaseLapsed(f"{self.key} lapsed")
        if held == -1:
            raise LeaseTaken(f"{self.key} was taken by another process")

    async def release(self) -> None:
        """Let go of the lease, in one step, if this process still holds it."""
        await self._release(keys=[self.key], args=[self.token])


async def beat(redis: Redis, info: WorkerInfo, lease: Lease) -> list[str]:
    """What keeps a worker live, in one script each heartbeat interval: its heartbeat, its lease's
    renewal and a look for silent members (whose jobs may need moving). Returns the silent members'
    ids; raises LeaseLapsed or LeaseTaken (`Lease.check`) once the heartbeat has gone out."""
    heartbeat_keys, heartbeat_args = heartbeat_arguments(info)
    held, silent = await redis.register_script(_BEAT)(
        keys=[*heartbeat_keys, lease.key], args=[*heartbeat_args, lease.token, LEASE_TTL_MS, LIVENESS_WINDOW])
    lease.check(held)
    return [w.decode() for w in silent]


async def resume_own_jobs(redis: Redis, queue: str) -> int:
    """After taking the lease: jobs our predecessor had started become runnable again."""
    cleared = int(await redis.register_script(_RESUME)(keys=[queue]))
    if cleared:
        log.info("resuming %d job(s) interrupted on %s", cleared, queue)
    return cleared


async def reap_vanished_workers(redis: Redis) -> int:
    """Move the jobs of workers whose lease lapsed to the next live worker in each job's ranking;
    returns how many jobs moved. Safe to run from every worker at once (a per-victim lock)."""
    stale = await silent_members(redis)
    if not stale:
        return 0
    live = await live_workers(redis)
    moved = 0
    for victim in stale:
        if await redis.exists(keys.lease_key(victim)):
            continue  # still owned (a restart is under way): its owner resumes the jobs
        if not await redis.set(keys.reap_lock_key(victim), b"1", nx=True, ex=30):
            continue
        moved += await _move_jobs(redis, victim, {w.id: w.queue for w in live})
    return moved


async def _move_jobs(redis: Redis, victim: str, queues: dict[str, str]) -> int:
    if not queues:
        return 0  # nowhere to go; they wait (or expire by their deadline)
    move = redis.register_script(_MOVE)
    moved = 0
    for raw in await redis.zrange(keys.queue_name(victim), 0, -1):
        arq_job_id = raw.decode()
        job_id = keys.job_of(arq_job_id)
        route_key = (await redis.hget(keys.job_key(job_id), "route_key") or job_id.encode()).decode()
        target = queues[rank_workers(route_key, list(queues))[0]]
        result = await move(keys=[keys.job_key(job_id), keys.lease_key(victim), keys.queue_name(victim), target],
                            args=[arq_job_id, job_id])
        if result == -1:
            log.info("worker %s is back; it resumes its remaining jobs", victim)
            return moved
        moved += result == 1
    await forget_member(redis, victim)
    if moved:
        log.warning("moved %d job(s) from vanished worker %s", moved, victim)
    return moved
