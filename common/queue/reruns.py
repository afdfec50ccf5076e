"""Running a job again after its engine failed it (unreachable, reset, 5xx, hung): scoring is pure, so
the job goes back to a queue as its next placement, as leases.py moves a vanished worker's jobs. It goes
to the next live worker in its prefix ranking whose engine is up; with none, back to the same worker's
queue, for when its engine answers again (or, should that worker stop, for its restart or for the live
worker that moves its jobs). The record counts the job's starts (`attempts`, records.py) and keeps why
it was last run again (`last_failure`)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from common.queue import keys
from common.queue.arq_layout import ARQ_LUA
from common.queue.membership import live_workers
from common.queue.placement import FAIR_ORIGIN_MS
from common.queue.records import RECORD_LUA
from common.routing import rank_workers

# KEYS: record, the placement's queue, the target queue; ARGV: arq job id, job id, why. 1: queued on the
# target as the job's next placement (its place in line kept: the same score, so the same lane and fair
# start; waiting to start again; its worker woken: arq_layout.py), with a
# copy of the payload; 0: not ours to run again (it ended, was cancelled or moved, or its payload expired).
# The placement's own arq keys stay for arq, which finishes it.
_RERUN = ARQ_LUA + RECORD_LUA + """
local f = redis.call('HMGET', KEYS[1], 'status', 'placement')
if f[2] ~= ARGV[1] or (f[1] ~= 'queued' and f[1] ~= 'running') then return 0 end
local payload, ttl = arq_payload(ARGV[1])
if not payload or ttl <= 0 then return 0 end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1]) or 'HEAD_OF_QUEUE'
local new = record_requeued(KEYS[1], ARGV[2], KEYS[3], {'last_failure', ARGV[3]})
local t = redis.call('TIME')
arq_enqueue(KEYS[3], new, payload, ttl, score, t[1] + t[2] / 1e6)
return 1
""".replace("HEAD_OF_QUEUE", str(-FAIR_ORIGIN_MS))


@dataclass(frozen=True)
class Rerun:
    """Where a job went to run again: `queue`, and whether it is the failing worker's own."""

    queue: str
    own: bool


async def run_again(redis: Redis, arq_job_id: str, worker_id: str, reason: str) -> Rerun | None:
    """Queue the job of `arq_job_id` (a placement `worker_id` runs and its engine failed) as its next
    placement: on the best live worker other than `worker_id`, or else on `worker_id`'s own queue. None
    when the job is no longer this placement's (it ended, was cancelled or moved meanwhile)."""
    job_id = keys.job_of(arq_job_id)
    own = keys.queue_name(worker_id)
    others = {w.id: w.queue for w in await live_workers(redis) if w.id != worker_id}
    if others:
        route_key = (await redis.hget(keys.job_key(job_id), "route_key") or job_id.encode()).decode()
        target = Rerun(others[rank_workers(route_key, list(others))[0]], own=False)
    else:
        target = Rerun(own, own=True)
    rerun = redis.register_script(_RERUN)
    queued = await rerun(keys=[keys.job_key(job_id), own, target.queue],
                         args=[arq_job_id, job_id, reason[:300]])
    return target if queued else None
