"""Wake-ups: a worker starts a job the moment it is queued and stops a cancelled one the moment it is
cancelled, instead of at arq's next poll. The scripts that queue, move and cancel placements publish
on the queue's wake channel (common/queue/keys.py); this listener hands a new placement to arq's own
`Worker.start_jobs`, which claims it exactly as arq's poll does (arq's in-progress key makes a second
start of the same job a no-op), and stops a cancelled one through `RunningJobs`.

A missed message costs latency, never a job: arq's poll (OPENJEV_WORKER_POLL_DELAY) finds the same
jobs and abort marks, so that poll can be slow and an idle worker nearly free (bench/RESULTS.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from arq import Worker
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from common.queue import keys
from worker.fencing import RunningJobs

log = logging.getLogger("openjev.worker")

RESUBSCRIBE_DELAY = 1.0  # seconds before subscribing again after an error, doubling up to the cap
MAX_RESUBSCRIBE_DELAY = 30.0  # (arq's poll covers the gap)


class WakeUps:
    """Listens on one queue's wake channel for as long as the worker runs."""

    def __init__(self, redis: Redis, queue: str, worker: Worker, running: RunningJobs) -> None:
        self.redis = redis
        self.channel = keys.wake_channel(queue)
        self.worker = worker
        self.running = running
        self._due: asyncio.Queue[bytes] = asyncio.Queue()
        self._pubsub: PubSub | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Send SUBSCRIBE before returning (so before the worker's first heartbeat makes it routable),
        then listen and start jobs in the background."""
        try:
            self._pubsub = await self._subscribe()
        except (RedisError, OSError) as exc:  # the listener keeps trying; arq's poll runs jobs meanwhile
            log.warning("wake-ups not subscribed (%r); arq's poll carries on", exc)
        self._tasks = [asyncio.create_task(self._listen(), name="wake-listen"),
                       asyncio.create_task(self._start_due(), name="wake-start")]

    def stop(self) -> None:
        """Start nothing more (the worker is stopping: arq's `on_stop`)."""
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        self.stop()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()

    async def _subscribe(self) -> PubSub:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.channel)
        return pubsub

    async def _listen(self) -> None:
        delay = RESUBSCRIBE_DELAY
        while True:
            try:
                if self._pubsub is None:
                    self._pubsub = await self._subscribe()
                async for message in self._pubsub.listen():
                    delay = RESUBSCRIBE_DELAY
                    await self._handle(message["data"])
            except (RedisError, OSError) as exc:
                log.warning("wake-ups paused (%r), retrying in %.0f s; arq's poll carries on", exc, delay)
                if self._pubsub is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await self._pubsub.aclose()
                    self._pubsub = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESUBSCRIBE_DELAY)

    async def _handle(self, data: bytes) -> None:
        verb, _, arq_job_id = data.partition(b" ")
        if verb == b"job":
            self._due.put_nowait(arq_job_id)
        elif verb == b"abort":
            self.running.abort(arq_job_id.decode())  # arq drops the abort mark as it finishes the placement

    async def _start_due(self) -> None:
        """One placement at a time: `start_jobs` waits for a free job slot, and the listener must
        stay free to act on cancellations meanwhile."""
        while True:
            arq_job_id = await self._due.get()
            if not self.worker.allow_pick_jobs:
                continue
            try:
                await self.worker.start_jobs([arq_job_id])  # a no-op for one arq's poll already claimed
            except (RedisError, OSError) as exc:
                log.warning("wake-up start of %s failed (%r); arq's poll will start it", arq_job_id, exc)
