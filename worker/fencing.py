"""What keeps a worker honest about which jobs are still its own: it renews its lease with every
heartbeat (worker/runner.py), and when the lease lapsed (the process was paused or cut off from
Redis for longer than the liveness window), other workers may have moved its jobs. It then takes a
new lease, so nothing more can move, and stops every job whose placement is no longer its own, which
aborts that job's engine calls; its outcome would be refused anyway (common/queue/records.py). The
same mark-and-cancel stops a job cancelled through a wake-up (worker/wakeups.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from enum import StrEnum

from common.queue.leases import Lease
from common.queue.records import JobStore

log = logging.getLogger("openjev.worker")


class StopReason(StrEnum):
    """Why this worker stopped one of its running placements itself."""

    cancelled = "cancelled"  # its job was cancelled (a wake-up): its ending is already stored
    moved = "moved"  # it was moved to another worker while this one was cut off (fencing)


class RunningJobs:
    """The placements (arq job ids) this worker is evaluating now, and the tasks evaluating them."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[object]] = {}
        self._stopped: dict[str, StopReason] = {}

    @contextlib.contextmanager
    def running(self, arq_job_id: str) -> Iterator[None]:
        """Register the current task as evaluating `arq_job_id` for the duration of the block."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks[arq_job_id] = task
        try:
            yield
        finally:
            self._tasks.pop(arq_job_id, None)

    def stop(self, arq_job_id: str, reason: StopReason) -> None:
        """Cancel `arq_job_id`'s task, if it is running here, recording why."""
        task = self._tasks.get(arq_job_id)
        if task is not None and not task.done():
            self._stopped[arq_job_id] = reason
            task.cancel()

    def stopped_because(self, arq_job_id: str) -> StopReason | None:
        """Why (once) `arq_job_id` was stopped by `stop`; None when it was not (arq's own abort, a shutdown)."""
        return self._stopped.pop(arq_job_id, None)

    async def fence(self, store: JobStore) -> list[str]:
        """Stop every running placement that is no longer its job's placement; returns them."""
        ids = list(self._tasks)
        if not ids:
            return []
        taken = [i for i, ours in zip(ids, await store.placements(ids), strict=True) if not ours]
        for arq_job_id in taken:
            self.stop(arq_job_id, StopReason.moved)
        return taken


async def take_back(lease: Lease, running: RunningJobs, store: JobStore) -> list[str]:
    """The lease had lapsed: take it anew before anything else, so nothing more can move (LeaseTaken
    when another process holds it now), then stop every running job moved meanwhile; returns them."""
    await lease.acquire(patience=0)
    taken = await running.fence(store)
    log.warning("lease %s had lapsed; taken again; %d job(s) moved meanwhile stopped here",
                lease.key, len(taken), extra={"event": "lease_lapsed", "stopped": taken})
    return taken
