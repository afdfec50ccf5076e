"""Branch slots are shared round-robin between jobs, and a cancelled waiter gives its turn away."""

from __future__ import annotations

import asyncio

from worker.branch_slots import BranchSlots


async def _hold(slots: BranchSlots, job: str, order: list[str], release: asyncio.Event) -> None:
    async with slots.slot(job):
        order.append(job)
        await release.wait()


async def test_a_freed_slot_goes_to_the_next_job_in_turn_not_the_longest_queue() -> None:
    slots = BranchSlots(1)
    order: list[str] = []
    gates = [asyncio.Event() for _ in range(6)]
    tasks = [asyncio.create_task(_hold(slots, "big", order, gates[0]))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(_hold(slots, "big", order, gates[i])) for i in (1, 2, 3)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(_hold(slots, "small", order, gates[4]))]
    await asyncio.sleep(0)
    for gate in gates[:5]:
        gate.set()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert order == ["big", "big", "small", "big", "big"]
    assert slots.in_use == 0 and slots.waiting == 0


async def test_a_cancelled_waiter_neither_leaks_nor_blocks_a_slot() -> None:
    slots = BranchSlots(1)
    order: list[str] = []
    release = asyncio.Event()
    holder = asyncio.create_task(_hold(slots, "a", order, release))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(_hold(slots, "b", order, release))
    late = asyncio.create_task(_hold(slots, "c", order, release))
    await asyncio.sleep(0)
    doomed.cancel()
    release.set()
    await asyncio.gather(holder, late)
    assert order == ["a", "c"]
    assert slots.in_use == 0 and slots.waiting == 0


async def test_capacity_bounds_calls_in_flight() -> None:
    slots = BranchSlots(3)
    peak = 0

    async def call() -> None:
        nonlocal peak
        async with slots.slot("j"):
            peak = max(peak, slots.in_use)
            await asyncio.sleep(0.01)

    await asyncio.gather(*(call() for _ in range(20)))
    assert peak == 3 and slots.in_use == 0
