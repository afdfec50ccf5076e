"""Claims: the one place a worker starts jobs. A worker starts a job the moment it is queued and stops a
cancelled one the moment it is cancelled, instead of at its next look at the queue. The scripts that
queue, move and cancel placements publish on the queue's wake channel (common/queue/keys.py); this
listener claims a new placement and starts its job (common/queue/claims.py: arq's claim and the record's
start, in one script), hands it to arq's own `Worker.run_job` (`evaluate` takes the start from `started`),
and stops a cancelled one through `RunningJobs`. Nothing is claimed while `ready` is clear (the engine is
not answering), so no job spends one of its runs meanwhile. When every job slot is busy,
announced placements wait here and the lowest score goes first as a slot frees, the order arq's poll
would take them in: the score carries the lane and the tenant's fair share (common/queue/placement.py),
so a sync request is started before a batch backlog announced earlier.

A missed message costs latency, never a job: every OPENJEV_WORKER_POLL_DELAY seconds this module also
looks at the queue itself and starts what is due there (what a wake-up missed, and a claim Redis broke
off; the same look ends the waiting sync jobs of a gone API, common/queue/presence.py), so that look can
be slow and an idle worker nearly free (bench/RESULTS.md). A worker that does not listen
(OPENJEV_WORKER_WAKEUPS=false) starts jobs on that look alone.

arq's own poll starts nothing (`allow_pick_jobs` is off from the start: it still reads cancellations
and keeps arq's health key). arq's claim, `Worker.start_jobs`, takes four round trips, and loses a job
slot when Redis drops out in the middle of it: it counts the job and takes a place in its semaphore
before the claim's first command, then WATCHes the job's in-progress key, and an error between that
WATCH and its MULTI (a lost connection, which redis-py turns into a WatchError while a key is watched, or
the LOADING answer of a Redis still reading its append-only file, which accepts WATCH but not EXISTS)
leaves both taken for good, or, from arq's poll, ends the worker's main loop. Here a slot is counted
only once its claim succeeded, and a claim that fails is tried again at the next look.

This module drives arq's `run_job`, `job_counter`, `max_jobs`, `tasks`, `queue_read_limit`,
`in_progress_timeout_s` and `allow_pick_jobs` from outside arq's loop, as `start_jobs` does inside it: no
documented arq call starts a given job at once, and this is the one place that does it (arq is pinned
exactly; tests/test_arq_surface.py checks that surface)."""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging

from arq import Worker
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.background import cancel_and_wait
from common.logs import RepeatedFailure
from common.queue import keys
from common.queue.claims import Claims
from common.queue.membership import WorkerCounters
from common.queue.records import Started
from common.queue.subscriptions import Subscription
from worker.fencing import RunningJobs, StopReason

log = logging.getLogger("openjev.worker")

MAX_RESUBSCRIBE_DELAY = 30.0  # seconds between tries while Redis refuses (the look at the queue covers the gap)


class WakeUps:
    """Starts one queue's jobs for as long as the worker runs: on its wake channel's notices (when
    `listen`) and on a look at the queue every `look_interval` seconds."""

    def __init__(self, redis: Redis, queue: str, worker: Worker, running: RunningJobs, *, worker_id: str,
                 look_interval: float, unseen_before: float, counters: WorkerCounters, sync_deadline: float,
                 listen: bool = True, ready: asyncio.Event | None = None) -> None:
        """`unseen_before`: the wait (s) past which a sync job starts only while its API is live
        (common/queue/presence.py); `counters`: where a job ended for that is counted ("gone"); `sync_deadline`:
        the longest a sync job lives (a look reads no waiting placement older)."""
        self.redis = redis
        self.queue = queue
        self.worker = worker
        self.running = running
        self.look_interval = look_interval
        self.claims = Claims(redis, queue, worker_id, worker.in_progress_timeout_s, unseen_before, sync_deadline)
        self.counters = counters
        self.ready = ready
        self._started: dict[str, Started | None] = {}  # arq job id -> its job's start, until `evaluate` takes it
        worker.allow_pick_jobs = False  # every claim goes through `_claim` (the module's docstring says why)
        self._subscription = Subscription(redis, keys.wake_channel(queue), self._handle,
                                          fallback="the look at the queue carries on", log=log, retry_delay=1.0,
                                          max_retry_delay=MAX_RESUBSCRIBE_DELAY) if listen else None
        self._due: list[tuple[float, int, bytes]] = []  # (score, arrival, arq job id): a heap, lowest score first
        self._waiting: set[bytes] = set()  # the arq job ids in `_due`
        self._arrivals = itertools.count()
        self._announced = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # While Redis is down each look and each claim fails: a warning at the first, then one every 10 s.
        self._look_failures = RepeatedFailure(log, f"look at queue {queue}")
        self._claim_failures = RepeatedFailure(log, f"claim of a job queued on {queue}")

    async def start(self) -> None:
        """Send SUBSCRIBE before returning (so before the worker's first heartbeat makes it routable),
        then listen, look and start jobs in the background."""
        if self._subscription is not None:
            await self._subscription.start()
        self._tasks = [asyncio.create_task(self._start_due(), name="claims"),
                       asyncio.create_task(self._look_regularly(), name="look at the queue")]

    def stop(self) -> None:
        """Start nothing more (the worker is stopping: arq's `on_stop`)."""
        if self._subscription is not None:
            self._subscription.stop()
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Stop, and release the subscription's connection."""
        for task in self._tasks:
            await cancel_and_wait(task)
        if self._subscription is not None:
            await self._subscription.close()

    async def look(self) -> None:
        """Take in what is due in the queue (as arq's poll would read it) and not already running here."""
        try:
            looked = await self.claims.look(self.worker.queue_read_limit)
        except (RedisError, OSError) as exc:
            self._look_failures.failed(exc, f"the next one, in {self.look_interval:g} s, tries again")
            return
        self._look_failures.succeeded()
        for arq_job_id in looked.gone:
            self._gone(arq_job_id)
        for arq_job_id, score in looked.due:
            if not self._runs_here(arq_job_id):
                self._announce(arq_job_id.encode(), score)

    def _runs_here(self, arq_job_id: str) -> bool:
        task = self.worker.tasks.get(arq_job_id)
        return task is not None and not task.done()

    async def _look_regularly(self) -> None:
        while True:
            await self.look()
            await asyncio.sleep(self.look_interval)

    def _handle(self, data: bytes) -> None:
        verb, _, rest = data.partition(b" ")
        if verb == b"job":
            arq_job_id, _, score = rest.partition(b" ")
            self._announce(arq_job_id, float(score) if score else float("inf"))
        elif verb == b"abort":
            # arq drops the abort mark as it finishes the placement
            self.running.stop(rest.decode(), StopReason.cancelled)

    def _announce(self, arq_job_id: bytes, score: float) -> None:
        if arq_job_id not in self._waiting:
            self._waiting.add(arq_job_id)
            heapq.heappush(self._due, (score, next(self._arrivals), arq_job_id))
            self._announced.set()

    async def _start_due(self) -> None:
        """One placement at a time, each once a job slot is free: of those announced by then, the lowest
        score; the listener stays free to act on cancellations meanwhile."""
        while True:
            while not self._due:
                self._announced.clear()
                await self._announced.wait()
            await self._free_slot()
            if self.ready is not None:
                await self.ready.wait()
            _, _, arq_job_id = heapq.heappop(self._due)
            self._waiting.discard(arq_job_id)
            await self._claim(arq_job_id)

    async def _claim(self, arq_job_id: bytes) -> None:
        """Claim one placement and run it in arq's `run_job` on a job slot (free: `_free_slot`); nothing for
        one running here already, claimed elsewhere, gone or deferred. A claim Redis breaks off leaves the
        job queued for the next look."""
        job_id = arq_job_id.decode()
        if self._runs_here(job_id):
            return
        try:
            claimed = await self.claims.claim(job_id)
        except (RedisError, OSError) as exc:
            self._claim_failures.failed(exc, f"{job_id} was broken off; the next look at the queue, within "
                                             f"{self.look_interval:g} s, starts it")
            return
        self._claim_failures.succeeded()
        if claimed is None:
            return
        if claimed.gone:
            self._gone(job_id)
            return
        self._started[job_id] = claimed.started
        self.worker.job_counter += 1  # what arq's `start_jobs` counts, given back as the job's task ends
        task = asyncio.create_task(self.worker.run_job(job_id, claimed.score), name=f"job {job_id}")
        task.add_done_callback(functools.partial(self._slot_freed, job_id))
        self.worker.tasks[job_id] = task

    def _gone(self, arq_job_id: str) -> None:
        """A placement whose job was a sync job of a gone API, ended and taken off the queue by a claim or a look."""
        self.counters.record_ending("gone")
        job_id = keys.job_of(arq_job_id)
        log.info("job %s: not run, its API process is gone (nobody is left to answer it)", job_id,
                 extra={"event": "caller_gone", "job_id": job_id})

    def started(self, arq_job_id: str) -> Started | None:
        """The start of the job of a placement claimed here (None: it may not run), once: `evaluate`'s."""
        return self._started.pop(arq_job_id, None)

    def _slot_freed(self, arq_job_id: str, _: asyncio.Task[None]) -> None:
        self.worker.job_counter -= 1
        self._started.pop(arq_job_id, None)  # arq ended it without `evaluate` (its payload expired)

    async def _free_slot(self) -> None:
        """Until the worker could start one more job: a placement that arrives while every slot is busy
        waits here for a running job to end (its task's first done callback, `_slot_freed`, gives the slot
        back before this waiter resumes)."""
        while self.worker.job_counter >= self.worker.max_jobs:
            running = [task for task in self.worker.tasks.values() if not task.done()]
            if not running:
                return  # cannot happen (each counted slot is a running task); never wait forever on it
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
