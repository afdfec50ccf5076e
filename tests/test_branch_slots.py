"""Branch slots are granted in batch-sized turns: a job gets what it asks for at once when slots are
free; under contention the job at the head of the line collects freed slots until it holds its turn (at
least half the slots, or all it wants), jobs take turns round-robin, and a cancelled waiter passes on
what it collected."""

from __future__ import annotations

import asyncio
import random

import pytest

from worker.branch_slots import BranchSlots


async def settle() -> None:
    """Let every task that can run, run (a few loop iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_job_is_granted_as_many_slots_as_are_free_up_to_what_it_asks() -> None:
    slots = BranchSlots(8)
    assert await slots.acquire("a", 5) == 5
    assert await slots.acquire("b", 3) == 3  # all it wants is free
    assert slots.in_use == 8
    slots.release(8)
    assert slots.in_use == 0


async def test_a_job_waits_for_a_useful_turn_rather_than_take_a_few_slots() -> None:
    slots = BranchSlots(8)  # a turn is at least 4 slots
    assert await slots.acquire("a", 6) == 6
    big = asyncio.create_task(slots.acquire("big", 8))  # 2 free: fewer than its turn
    await settle()
    assert not big.done() and slots.in_use == 8  # it holds the 2 while it waits
    slots.release(1)
    await settle()
    assert not big.done()
    slots.release(5)  # nobody behind it: its turn of 4 and whatever else is free
    assert await big == 8
    slots.release(8)
    assert slots.in_use == 0


async def test_slots_freed_a_few_at_a_time_go_out_as_whole_turns_round_robin() -> None:
    slots = BranchSlots(12)  # turns of 6
    assert await slots.acquire("first", 12) == 12
    waiting = {name: asyncio.create_task(slots.acquire(name, 10)) for name in ("a", "b", "c")}
    for _ in range(5):
        slots.release(1)  # calls finishing one prompt at a time: a collects them
        await settle()
    assert not any(task.done() for task in waiting.values())
    slots.release(1)
    assert await waiting["a"] == 6  # its turn, not what it wanted: b and c wait behind it
    slots.release(6)
    assert await waiting["b"] == 6
    assert not waiting["c"].done()
    slots.release(6)  # a's call ends: c's turn (b still holds the other 6)
    assert await waiting["c"] == 6
    assert slots.in_use == 12
    slots.release(12)
    assert slots.in_use == 0


async def test_a_job_granted_less_than_it_asked_asks_again_behind_the_others() -> None:
    slots = BranchSlots(4)  # turns of 2
    assert await slots.acquire("big", 4) == 4
    first = asyncio.create_task(slots.acquire("big", 10))
    other = asyncio.create_task(slots.acquire("small", 1))
    await settle()
    slots.release(2)
    assert await first == 2  # big was first in line
    again = asyncio.create_task(slots.acquire("big", 8))
    await settle()
    slots.release(1)
    assert await other == 1  # small is next, before big's second turn
    assert not again.done()
    slots.release(3)
    assert await again == 3  # its turn of 2, and the one more free with nobody behind it
    slots.release(4)
    assert slots.in_use == 0


async def test_a_cancelled_waiter_passes_on_the_slots_it_collected() -> None:
    slots = BranchSlots(4)
    assert await slots.acquire("a", 4) == 4
    doomed = asyncio.create_task(slots.acquire("b", 4))
    late = asyncio.create_task(slots.acquire("c", 2))
    await settle()
    slots.release(1)  # b collects it
    await settle()
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    slots.release(1)
    assert await late == 2  # b's slot and the new one
    slots.release(2 + 2)
    assert slots.in_use == 0


async def test_slots_granted_to_a_waiter_cancelled_before_it_woke_pass_on() -> None:
    slots = BranchSlots(2)
    assert await slots.acquire("a", 2) == 2
    doomed = asyncio.create_task(slots.acquire("b", 2))
    await settle()
    slots.release(2)  # dealt to b, which has not run yet
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert slots.in_use == 0
    assert await slots.acquire("c", 2) == 2


async def test_a_waiter_cancelled_in_the_same_step_as_a_release_neither_breaks_nor_leaks() -> None:
    slots = BranchSlots(4)
    assert await slots.acquire("a", 4) == 4
    doomed = asyncio.create_task(slots.acquire("b", 4))
    await settle()
    doomed.cancel()  # its future is cancelled now; its except clause runs later
    slots.release(4)  # dealing meets the cancelled wait first
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert slots.in_use == 0
    assert await slots.acquire("c", 4) == 4


async def test_capacity_bounds_branches_in_flight_and_every_job_finishes() -> None:
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
    assert peak == 5 and slots.in_use == 0


async def test_sixteen_64_branch_jobs_under_contention_each_send_at_most_two_calls() -> None:
    """The issue-29 workload as the worker runs it (64 slots, batches of up to 64): each job asks for
    its next batch while its earlier calls run, and each call frees its slots after a random time.
    The old dealing (a fair share of the slots freed, at once) made calls of 1-4 prompts here."""
    slots = BranchSlots(64)
    rng = random.Random(29)
    calls: dict[str, list[int]] = {}

    async def call(name: str, size: int) -> None:
        await asyncio.sleep(rng.random() / 50)
        slots.release(size)

    async def job(name: str) -> None:
        await asyncio.sleep(rng.random() / 100)  # warm calls end at different times
        sent, running = 0, []
        while sent < 64:
            granted = await slots.acquire(name, 64 - sent)
            calls.setdefault(name, []).append(granted)
            running.append(asyncio.create_task(call(name, granted)))
            sent += granted
        await asyncio.gather(*running)

    await asyncio.gather(*(job(f"j{i}") for i in range(16)))
    assert slots.in_use == 0
    assert all(sum(sizes) == 64 for sizes in calls.values())
    assert max(len(sizes) for sizes in calls.values()) <= 2, calls
