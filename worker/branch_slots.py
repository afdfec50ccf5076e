"""A worker's branch slots, shared fairly between jobs. A job asks for as many slots as it has
branches left and is granted between one and that many at once (they go out in one batched engine
call); when slots free they are dealt round-robin across the waiting jobs in turns of a fair share
(capacity ÷ jobs waiting, at least one), so a 64-question job cannot starve another job's branches and
slots freed a few at a time under contention still go out as batches, not as calls of one branch."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity: two waits with the same figures are still two waits
class _Request:
    """One job's wait for slots."""

    job_id: str
    wanted: int
    granted: int = 0
    ready: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BranchSlots:
    """At most `capacity` branch calls in flight, granted round-robin across jobs."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiting: OrderedDict[str, deque[_Request]] = OrderedDict()

    @property
    def waiting(self) -> int:
        """Requests waiting for slots."""
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, job_id: str, wanted: int) -> int:
        """Wait until `job_id` holds between 1 and `wanted` slots; returns how many. The caller must
        `release()` that many."""
        if wanted < 1:
            raise ValueError("wanted must be at least 1")
        if self.in_use < self.capacity and not self._waiting:
            granted = min(wanted, self.capacity - self.in_use)
            self.in_use += granted
            return granted
        request = _Request(job_id, wanted)
        self._waiting.setdefault(job_id, deque()).append(request)
        try:
            return await request.ready
        except asyncio.CancelledError:
            if request.ready.done() and not request.ready.cancelled():
                self.release(request.granted)  # the slots arrived as we were cancelled: pass them on
            else:
                self._forget(job_id, request)
            raise

    def release(self, count: int) -> None:
        """Give back `count` slots; they pass straight to waiting jobs, a fair share each in turn."""
        dealt: list[_Request] = []
        share = max(1, self.capacity // max(1, len(self._waiting)))
        while count and self._waiting:
            job_id, queue = next(iter(self._waiting.items()))
            request = queue[0]
            if request.ready.done():  # cancelled while waiting
                queue.popleft()
            else:
                given = min(share, count, request.wanted - request.granted)
                request.granted += given
                count -= given
                if request.granted == given:
                    dealt.append(request)
                if request.granted == request.wanted:
                    queue.popleft()
            if not queue:
                del self._waiting[job_id]
            else:
                self._waiting.move_to_end(job_id)  # this job waits its turn again
        for request in dealt:
            self._forget(request.job_id, request)  # granted fewer than it wanted: its job asks again
            request.ready.set_result(request.granted)
        self.in_use -= count

    def _forget(self, job_id: str, request: _Request) -> None:
        queue = self._waiting.get(job_id)
        if queue is None or request not in queue:
            return
        queue.remove(request)
        if not queue:
            del self._waiting[job_id]
