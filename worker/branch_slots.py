"""A worker's branch slots, shared fairly between jobs: when a slot frees it goes to the next job
in round-robin order, so a 64-question job cannot starve another job's branches."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BranchSlots:
    """At most `capacity` branch calls in flight, granted round-robin across jobs."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @asynccontextmanager
    async def slot(self, job_id: str) -> AsyncIterator[None]:
        """Hold one slot for the duration of a branch call of `job_id`."""
        await self._acquire(job_id)
        try:
            yield
        finally:
            self._release()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def _acquire(self, job_id: str) -> None:
        if self.in_use < self.capacity and not self._waiting:
            self.in_use += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot arrived as we were cancelled: pass it on
            else:
                self._forget(job_id, granted)
            raise

    def _release(self) -> None:
        while self._waiting:
            job_id, queue = next(iter(self._waiting.items()))
            granted = queue.popleft()
            if queue:
                self._waiting.move_to_end(job_id)  # this job waits its turn again
            else:
                del self._waiting[job_id]
            if not granted.done():
                granted.set_result(None)  # the slot passes on; in_use is unchanged
                return
        self.in_use -= 1

    def _forget(self, job_id: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(job_id)
        if queue is None:
            return
        try:
            queue.remove(granted)
        except ValueError:
            return
        if not queue:
            del self._waiting[job_id]
