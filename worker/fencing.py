"""What keeps a worker honest about which jobs are still its own: it renews its lease on its own
schedule, and when the lease lapsed (the process was paused or cut off from Redis for longer than
the liveness window), other workers may have moved its jobs. It then takes a new lease, so nothing
more can move, and stops every job whose placement is no longer its own, which aborts that job's
engine calls; its outcome would be refused anyway (common/queue/records.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from redis.exceptions import RedisError

from common.queue.leases import Lease, LeaseLapsed
from common.queue.membership import HEARTBEAT_INTERVAL
from common.queue.records import JobStore

log = logging.getLogger("openjev.worker")


class RunningJobs:
    """The placements (arq job ids) this worker is evaluating now, and the tasks evaluating them."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[object]] = {}
        self._fenced: set[str] = set()
        self._aborted: set[str] = set()

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

    def was_fenced(self, arq_job_id: str) -> bool:
        """True (once) when `arq_job_id` was stopped because it was taken from this worker."""
        if arq_job_id in self._fenced:
            self._fenced.discard(arq_job_id)
            return True
        return False

    def abort(self, arq_job_id: str) -> bool:
        """Cancel `arq_job_id` if it is running here (its job was cancelled: its ending is already
        stored); True if it was."""
        task = self._tasks.get(arq_job_id)
        if task is None or task.done():
            return False
        self._aborted.add(arq_job_id)
        task.cancel()
        return True

    def was_aborted(self, arq_job_id: str) -> bool:
        """True (once) when `arq_job_id` was stopped by `abort`."""
        if arq_job_id in self._aborted:
            self._aborted.discard(arq_job_id)
            return True
        return False

    async def fence(self, store: JobStore) -> list[str]:
        """Cancel every running placement that is no longer its job's placement; returns them."""
        ids = list(self._tasks)
        if not ids:
            return []
        taken = [i for i, ours in zip(ids, await store.placements(ids), strict=True) if not ours]
        for arq_job_id in taken:
            task = self._tasks.get(arq_job_id)
            if task is not None:
                self._fenced.add(arq_job_id)
                task.cancel()
        return taken


async def hold_lease(lease: Lease, running: RunningJobs, store: JobStore) -> None:
    """Renew the lease every heartbeat interval, never behind a slow engine check. A lapsed lease is
    taken anew before the running jobs are checked; raises LeaseTaken when another process holds it."""
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        try:
            await lease.renew()
        except LeaseLapsed:
            await lease.acquire(patience=0)
            taken = await running.fence(store)
            log.warning("lease %s had lapsed; taken again; %d job(s) moved meanwhile stopped here",
                        lease.key, len(taken), extra={"event": "lease_lapsed", "stopped": taken})
        except (RedisError, OSError) as exc:  # a Redis blip must not end the loop; a long one lapses the lease
            log.warning("lease renewal failed: %r", exc)

