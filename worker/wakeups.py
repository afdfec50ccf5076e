"""Wake-ups: a worker starts a job the moment it is queued and stops a cancelled one the moment it is
cancelled, instead of at arq's next poll. The scripts that queue, move and cancel placements publish
on the queue's wake channel (common/queue/keys.py); this listener hands a new placement to arq's own
`Worker.start_jobs`, which claims it exactly as arq's poll does (arq's in-progress key makes a second
start of the same job a no-op), and stops a cancelled one through `RunningJobs`. When every job slot is
busy, announced placements wait here and the lowest score goes first as a slot frees, the order arq's
poll takes them in: the score carries the lane and the tenant's fair share (common/queue/placement.py),
so a sync request is started before a batch backlog announced earlier.

This hop drives arq's `start_jobs`, `job_counter`, `max_jobs`, `tasks` and `allow_pick_jobs` from outside
arq's loop: no documented arq call starts a given job at once, and the module is the one place that
does it (arq is pinned exactly; tests/test_arq_surface.py checks that surface).

A missed message costs latency, never a job: arq's poll (OPENJEV_WORKER_POLL_DELAY) finds the same
jobs and abort marks, so that poll can be slow and an idle worker nearly free (bench/RESULTS.md)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging

from arq import Worker
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.background import cancel_and_wait
from common.queue import keys
from common.queue.subscriptions import Subscription
from worker.fencing import RunningJobs, StopReason

log = logging.getLogger("openjev.worker")

MAX_RESUBSCRIBE_DELAY = 30.0  # seconds between tries while Redis refuses (arq's poll covers the gap)


class WakeUps:
    """Listens on one queue's wake channel for as long as the worker runs."""

    def __init__(self, redis: Redis, queue: str, worker: Worker, running: RunningJobs) -> None:
        self.worker = worker
        self.running = running
        self._subscription = Subscription(redis, keys.wake_channel(queue), self._handle,
                                          fallback="arq's poll carries on", log=log, retry_delay=1.0,
                                          max_retry_delay=MAX_RESUBSCRIBE_DELAY)
        self._due: list[tuple[float, int, bytes]] = []  # (score, arrival, arq job id): a heap, lowest score first
        self._arrivals = itertools.count()
        self._announced = asyncio.Event()
        self._starter: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Send SUBSCRIBE before returning (so before the worker's first heartbeat makes it routable),
        then listen and start jobs in the background."""
        await self._subscription.start()
        self._starter = asyncio.create_task(self._start_due(), name="wake-start")

    def stop(self) -> None:
        """Start nothing more (the worker is stopping: arq's `on_stop`)."""
        self._subscription.stop()
        if self._starter is not None:
            self._starter.cancel()

    async def close(self) -> None:
        """Stop, and release the subscription's connection."""
        await cancel_and_wait(self._starter)
        await self._subscription.close()

    def _handle(self, data: bytes) -> None:
        verb, _, rest = data.partition(b" ")
        if verb == b"job":
            arq_job_id, _, score = rest.partition(b" ")
            heapq.heappush(self._due, (float(score) if score else float("inf"), next(self._arrivals), arq_job_id))
            self._announced.set()
        elif verb == b"abort":
            # arq drops the abort mark as it finishes the placement
            self.running.stop(rest.decode(), StopReason.cancelled)

    async def _start_due(self) -> None:
        """One placement at a time, each once a job slot is free: of those announced by then, the lowest
        score; the listener stays free to act on cancellations meanwhile."""
        while True:
            while not self._due:
                self._announced.clear()
                await self._announced.wait()
            await self._free_slot()
            _, _, arq_job_id = heapq.heappop(self._due)
            if not self.worker.allow_pick_jobs:
                continue
            try:
                await self.worker.start_jobs([arq_job_id])  # a no-op for one arq's poll already claimed
            except (RedisError, OSError) as exc:
                log.warning("wake-up start of %s failed (%r); arq's poll will start it", arq_job_id, exc)

    async def _free_slot(self) -> None:
        """Until the worker could start one more job. arq's `start_jobs` drops a job it has no slot for
        (its semaphore admits one caller past `max_jobs`, then the job count turns it away), and only
        arq's next poll would find that job again: at capacity, every queued job would wait for a poll.
        So a placement that arrives while every slot is busy waits here for a running job to end (arq
        frees the slot in that task's first done callback, before this waiter resumes)."""
        while self.worker.job_counter >= self.worker.max_jobs:
            running = [task for task in self.worker.tasks.values() if not task.done()]
            if not running:
                return  # a slot is being taken or given back at this moment: `start_jobs` decides
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
