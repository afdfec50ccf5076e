"""Keep every core of this machine from idling while a bench runs: one busy loop per core at the lowest
priority (nice 19), so the measured processes preempt it at once but a core never halts. On a VM whose
idle vCPU halts at once (this one boots with `haltpoll.guest_halt_poll_ns=0`), every hand-off to a
sleeping process pays for waking a halted vCPU; running a bench both ways in one command shows what
that costs (bench/RESULTS.md)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import os; os.nice(19)\nwhile True: pass"


@contextlib.contextmanager
def awake_cores(enabled: bool = True) -> Iterator[None]:
    """With `enabled`, one nice-19 busy loop per core for the duration of the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 1)] if enabled else []
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
