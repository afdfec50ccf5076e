"""Background work (common/background.py): held until it ends, a failure logged with its owner's
message, and whatever is unfinished at close cancelled and awaited."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from common.background import BackgroundWork

log = logging.getLogger("openjev.test.background")


async def test_background_work_runs_to_its_end_with_no_one_else_holding_it() -> None:
    work = BackgroundWork(log)
    done = asyncio.Event()

    async def errand() -> None:
        await asyncio.sleep(0.01)
        done.set()

    work.start(errand(), "the errand failed")  # the task is not kept by the caller
    gc.collect()
    assert len(work) == 1
    await asyncio.wait_for(done.wait(), 2)
    await asyncio.sleep(0)  # its done callback runs on the next turn
    assert len(work) == 0


async def test_a_failed_errand_is_logged_with_its_message_and_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    work = BackgroundWork(log)

    async def failing() -> None:
        raise ConnectionError("redis went away")

    task = work.start(failing(), "could not drop job j1's record")
    with caplog.at_level(logging.WARNING, logger=log.name):
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records] == [
        "could not drop job j1's record (ConnectionError('redis went away'))"]
    assert len(work) == 0


async def test_close_cancels_unfinished_work_without_logging_it_as_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    work = BackgroundWork(log)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def long_errand() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    work.start(long_errand(), "the long errand failed")
    await started.wait()
    with caplog.at_level(logging.WARNING, logger=log.name):
        await asyncio.wait_for(work.close(), 2)
    assert cancelled.is_set()
    assert len(work) == 0
    assert caplog.records == []
