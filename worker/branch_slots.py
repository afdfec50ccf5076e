"""A worker's branch slots, shared fairly between jobs, dealt in batch-sized turns. A job asks for as
many slots as it has branches left (up to the batch size) and is granted them in one turn that goes out
as one batched engine call. When slots are short, jobs wait in line, round-robin: the job at the head
collects freed slots until it holds its turn, at least `min_turn` slots (half the capacity by default)
or everything it still wants, whichever is less; then it is granted and goes to the back of the line for
its next turn. Slots freed a few at a time under contention therefore never leave as calls of one or two
branches (a 64-question job makes at most two branch calls at the default 64 slots), and no job can hold
more than its turn while others wait, so a big job cannot starve a small one."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity: two waits with the same figures are still two waits
class _Request:
    """One job's wait for slots."""

    job_id: str
    wanted: int
    granted: int = 0  # slots collected so far (counted in `in_use`)
    ready: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BranchSlots:
    """At most `capacity` branch calls in flight, granted in turns of at least `min_turn` slots."""

    def __init__(self, capacity: int, min_turn: int | None = None) -> None:
        """`min_turn`: the fewest slots a waiting job is granted at once (unless it wants fewer);
        by default half the capacity, rounded up."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.min_turn = max(1, min(capacity, min_turn if min_turn is not None else -(-capacity // 2)))
        self.in_use = 0  # slots held by calls in flight and by the job collecting at the head of the line
        self._waiting: deque[_Request] = deque()  # in turn order (a job waits for one turn at a time)

    async def acquire(self, job_id: str, wanted: int) -> int:
        """Wait until `job_id` holds its turn of slots (between 1 and `wanted`); returns how many. The
        caller must `release()` that many. A job waits for one turn at a time."""
        if wanted < 1:
            raise ValueError("wanted must be at least 1")
        free = self.capacity - self.in_use
        if not self._waiting and free >= min(wanted, self.min_turn):
            granted = min(wanted, free)
            self.in_use += granted
            return granted
        request = _Request(job_id, wanted)
        self._waiting.append(request)
        self._deal()
        try:
            return await request.ready
        except asyncio.CancelledError:
            if request.ready.done() and not request.ready.cancelled():
                self.release(request.granted)  # the slots arrived as we were cancelled: pass them on
            elif request in self._waiting:
                self._waiting.remove(request)
                self.release(request.granted)  # what it had collected goes to the next in line
            raise

    def release(self, count: int) -> None:
        """Give back `count` slots; they go to the job at the head of the line."""
        self.in_use -= count
        self._deal()

    def _deal(self) -> None:
        """Hand free slots to the head of the line; grant each job whose turn is whole, in order."""
        while self._waiting:
            request = self._waiting[0]
            if request.ready.done():  # its task was cancelled and has not run yet: the slots go on
                self._waiting.popleft()
                self.in_use -= request.granted
                continue
            turn = min(request.wanted, self.min_turn)
            given = max(0, min(turn - request.granted, self.capacity - self.in_use))
            request.granted += given
            self.in_use += given
            if request.granted < turn:
                return  # it collects what the next calls free
            if len(self._waiting) == 1:  # nobody behind it: it takes what else is free, as it would on arrival
                extra = min(request.wanted - request.granted, self.capacity - self.in_use)
                request.granted += extra
                self.in_use += extra
            self._waiting.popleft()
            request.ready.set_result(request.granted)
