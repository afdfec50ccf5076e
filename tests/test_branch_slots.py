"""Branch slots are granted by size (a job gets up to what it asks for, in one grant), freed slots are
dealt round-robin between waiting jobs in turns of a fair share, and a cancelled waiter gives its turn away."""

from __future__ import annotations

import asyncio
import random

import pytest

from worker.branch_slots import BranchSlots


async def test_a_job_is_granted_as_many_slots_as_are_free_up_to_what_it_asks() -> None:
    slots = BranchSlots(8)
    assert await slots.acquire("a", 5) == 5
    assert await slots.acquire("b", 5) == 3
    assert slots.in_use == 8
    slots.release(8)
    assert slots.in_use == 0


async def test_freed_slots_are_dealt_one_each_in_turn_not_all_to_the_biggest_job() -> None:
    slots = BranchSlots(4)
    assert await slots.acquire("big", 64) == 4
    big = asyncio.create_task(slots.acquire("big", 60))
    await asyncio.sleep(0)
    small = asyncio.create_task(slots.acquire("small", 1))
    await asyncio.sleep(0)
    medium = asyncio.create_task(slots.acquire("medium", 3))
    await asyncio.sleep(0)
    slots.release(4)  # dealt big, small, medium, big
    assert (await big, await small, await medium) == (2, 1, 1)
    assert slots.in_use == 4 and slots.waiting == 0
    slots.release(4)
    assert slots.in_use == 0


async def test_slots_freed_a_few_at_a_time_go_out_in_fair_shares_not_one_by_one() -> None:
    slots = BranchSlots(12)
    assert await slots.acquire("first", 12) == 12
    waiting = [asyncio.create_task(slots.acquire(name, 10)) for name in ("a", "b", "c")]
    await asyncio.sleep(0)
    slots.release(4)  # one call of 4 branches finished: a fair share is 12 / 3 jobs = 4, all to a
    await asyncio.sleep(0)
    assert [task.done() for task in waiting] == [True, False, False]
    assert await waiting[0] == 4
    slots.release(8)  # two jobs wait now: a share is 12 / 2 = 6, so b gets 6 and c the 2 left, in one batch each
    assert (await waiting[1], await waiting[2]) == (6, 2)
    assert slots.in_use == 12 and slots.waiting == 0
    slots.release(12)
    assert slots.in_use == 0


async def test_a_job_granted_less_than_it_asked_asks_again_behind_the_others() -> None:
    slots = BranchSlots(2)
    assert await slots.acquire("big", 2) == 2
    first = asyncio.create_task(slots.acquire("big", 10))
    await asyncio.sleep(0)
    other = asyncio.create_task(slots.acquire("small", 1))
    await asyncio.sleep(0)
    slots.release(1)
    assert await first == 1  # big was first in line; small is next
    again = asyncio.create_task(slots.acquire("big", 9))
    await asyncio.sleep(0)
    slots.release(1)
    assert await other == 1
    assert not again.done()
    slots.release(2)
    assert await again == 2
    slots.release(2)
    assert slots.in_use == 0 and slots.waiting == 0


async def test_a_cancelled_waiter_neither_leaks_nor_blocks_a_slot() -> None:
    slots = BranchSlots(1)
    assert await slots.acquire("a", 1) == 1
    doomed = asyncio.create_task(slots.acquire("b", 3))
    late = asyncio.create_task(slots.acquire("c", 1))
    await asyncio.sleep(0)
    doomed.cancel()
    slots.release(1)
    assert await late == 1
    with pytest.raises(asyncio.CancelledError):
        await doomed
    slots.release(1)
    assert slots.in_use == 0 and slots.waiting == 0


async def test_slots_granted_to_a_waiter_cancelled_before_it_woke_pass_on() -> None:
    slots = BranchSlots(2)
    assert await slots.acquire("a", 2) == 2
    doomed = asyncio.create_task(slots.acquire("b", 2))
    await asyncio.sleep(0)
    slots.release(2)  # dealt to b, which has not run yet
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert slots.in_use == 0
    assert await slots.acquire("c", 2) == 2


async def test_capacity_bounds_branches_in_flight() -> None:
    slots = BranchSlots(5)
    peak = 0
    rng = random.Random(7)

    async def job(name: str, branches: int) -> None:
        nonlocal peak
        while branches:
            granted = await slots.acquire(name, branches)
            assert 1 <= granted <= branches
            peak = max(peak, slots.in_use)
            await asyncio.sleep(rng.random() / 100)
            slots.release(granted)
            branches -= granted

    await asyncio.gather(*(job(f"j{i}", rng.randint(1, 12)) for i in range(20)))
    assert peak == 5 and slots.in_use == 0 and slots.waiting == 0
