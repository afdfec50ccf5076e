"""Work a caller starts and does not wait for (dropping a sync job's record after its answer went out,
repeating an abort): each task is held until it ends, since asyncio keeps only a weak reference to a
running task, and a failure is logged where it happens instead of surfacing as "Task exception was
never retrieved" at garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine
from typing import Any


class BackgroundWork:
    """The unfinished background tasks of one owner (an API's queue, a worker's engine client)."""

    def __init__(self, log: logging.Logger) -> None:
        """`log`: where a task's failure is reported."""
        self._log = log
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Tasks not ended yet."""
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, None], failure: str) -> asyncio.Task[None]:
        """Run `work` in the background; if it raises, log `failure` with the error as a warning."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, failure))
        return task

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the tasks started so far to end."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def close(self) -> None:
        """Cancel what has not ended and wait for it to stop."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, failure: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._log.warning("%s (%r)", failure, error)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: there is none) and wait until it has stopped; its cancellation ends here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
