"""A worker's claim of one placement on its own queue, and the start of its job: what arq's
`Worker.start_jobs` checks and writes (no claim held by another, still queued, due), then the job record's
start (records.py `record_start`: the record names this placement and the job has not ended), in one
script instead of arq's four round trips and the start's own. A sync job whose API process is gone
(presence.py) ends there instead, and its placement leaves the queue; the worker's regular look at its
queue (`Claims.look`) ends such jobs while they wait. worker/wakeups.py then hands the job to
arq's own `Worker.run_job`, and `evaluate` takes the start from there. A placement is claimed even when
its job may not start (moved, cancelled or ended meanwhile), so that arq finishes it and drops its keys;
either way, a claimed placement leaves the queue's waiting set in the same script.
The claim names the worker process that holds it (its worker id and a token of its own), so a claim whose
reply the process lost (Redis restarting, the connection cut) is taken again at its next look at the queue
instead of standing until it expires, while one held by another process (a paused one whose lease lapsed,
or arq's own "1") is left alone."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from arq.utils import timestamp_ms
from redis.asyncio import Redis

from common.queue import keys
from common.queue.arq_layout import ARQ_LUA
from common.queue.presence import GONE_OUTCOME
from common.queue.records import START_LUA, Started, started_from

# KEYS[1] the queue, KEYS[2] the job's record, KEYS[3] the done channel; ARGV: arq job id, the claim's holder, its
# clock (ms), how long the claim holds (ms), the worker's id, the job id, the wait (s) past which a sync job's API is
# looked at, the outcome of a sync job whose API is gone. Nothing unless claimed; then {score, record_start's reply
# or nil}. A job whose API is gone ('gone') is taken off the queue with its arq keys, as a cancel takes off one that
# has not started: arq has nothing of it to run or finish.
_CLAIM = ARQ_LUA + START_LUA + """
local score = arq_claim(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
if not score then return false end
local started = record_start(KEYS[2], ARGV[1], ARGV[5], ARGV[6], KEYS[3], tonumber(ARGV[7]), ARGV[8])
if started == 'gone' then
  arq_take_off(KEYS[1], ARGV[1])
  return {score, started}
end
-- Claimed, it waits no more, whether it starts or not.
redis.call('ZREM', KEYS[1] .. ':waiting', ARGV[1])
return {score, started}
"""

# KEYS[1] the queue, KEYS[2] the done channel; ARGV: the worker's clock (ms), the most placements to read, the wait
# (s) past which a sync job's API is looked at, the outcome of a sync job whose API is gone, the longest a sync job
# waits (s: its deadline; a placement waiting longer is an async job, not looked at). A worker's regular look
# at its own queue: first the placements waiting there whose jobs are sync jobs of a gone API end and are taken off
# (`record_sweep_gone`, at most SWEEP_LIMIT a look), so none of them counts as ahead of a new job or in the backlog
# until the worker would reach it; then what is due, as arq's poll reads it. {placements swept, {id, score, ...}}.
_LOOK = ARQ_LUA + START_LUA + """
local swept = record_sweep_gone(KEYS[1], KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[5]), ARGV[4], SWEEP_LIMIT)
for _, placement in ipairs(swept) do arq_take_off(KEYS[1], placement) end
return {swept, redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))}
"""
SWEEP_LIMIT = 100  # placements a look may end as gone; more wait for the next look (or their claims)
SYNC_DEADLINE_UNKNOWN = 10**9  # seconds: every waiting placement past the threshold is looked at
_LOOK = _LOOK.replace("SWEEP_LIMIT", str(SWEEP_LIMIT))


@dataclass(frozen=True)
class Looked:
    """What a look at the queue found: the placements due (arq job id, score), lowest score first, and those whose
    jobs it ended because their API is gone."""

    due: list[tuple[str, float]]
    gone: list[str]


@dataclass(frozen=True)
class Claimed:
    """A placement claimed here: its queue score, and its job's start (None: the job may not run). `gone`: its
    job was a sync job whose API is gone (common/queue/presence.py), so it ended instead and the placement left
    the queue: there is nothing to run."""

    score: int
    started: Started | None
    gone: bool = False


class Claims:
    """Claims placements on `queue` for this process of worker `worker_id`, each held `hold_s` seconds
    (arq's `in_progress_timeout_s`: longer than any job runs); a sync job that waited `unseen_before` seconds
    or more is started only while its API is live (common/queue/presence.py). `sync_deadline`: the longest a
    sync job lives (OPENJEV_REQUEST_TIMEOUT), past which a look at the queue reads no waiting placement."""

    def __init__(self, redis: Redis, queue: str, worker_id: str, hold_s: float, unseen_before: float,
                 sync_deadline: float = SYNC_DEADLINE_UNKNOWN) -> None:
        self.queue = queue
        self.unseen_before = unseen_before
        self.sync_deadline = min(sync_deadline, SYNC_DEADLINE_UNKNOWN)
        self.worker_id = worker_id
        self.holder = f"{worker_id}/{secrets.token_hex(4)}"
        self.hold_ms = int(hold_s * 1000)
        self._claim = redis.register_script(_CLAIM)
        self._look = redis.register_script(_LOOK)

    async def claim(self, arq_job_id: str) -> Claimed | None:
        """The placement claimed here, with its job's start; None when it is not to be run here now
        (claimed by another, no longer queued, or deferred). The worker's own clock decides what is due,
        as arq's does."""
        job_id = keys.job_of(arq_job_id)
        reply = await self._claim(keys=[self.queue, keys.job_key(job_id), keys.DONE_CHANNEL],
                                  args=[arq_job_id, self.holder, timestamp_ms(), self.hold_ms, self.worker_id, job_id,
                                        repr(self.unseen_before), GONE_OUTCOME])
        if reply is None:
            return None
        score, start = [*reply, None][:2]
        if start == b"gone":
            return Claimed(int(float(score)), None, gone=True)
        return Claimed(int(float(score)), started_from(start))

    async def look(self, limit: int) -> Looked:
        """The placements due on the queue by the worker's clock, up to `limit` (what arq's poll reads), after
        ending those waiting there whose jobs' API is gone."""
        swept, due = await self._look(keys=[self.queue, keys.DONE_CHANNEL],
                                      args=[timestamp_ms(), limit, repr(self.unseen_before), GONE_OUTCOME,
                                            repr(self.sync_deadline)])
        return Looked(due=[(due[i].decode(), float(due[i + 1])) for i in range(0, len(due), 2)],
                      gone=[placement.decode() for placement in swept])
