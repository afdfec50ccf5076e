"""What /proc says about a process's CPU time and wake-ups, for the benchmarks and the tests that
measure a process at rest."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def run_seconds(pid: int) -> float:
    """Time a process's live threads have spent on a CPU so far, to the nanosecond (/proc/PID/task/*/schedstat):
    finer than /proc/PID/stat's 10 ms ticks for the few CPU-ms a process at rest uses."""
    total = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += int(schedstat.read_text().split()[0])
    return total / 1e9


def wakeups(pid: int) -> int:
    """How often a process's threads have slept and been woken so far (voluntary context switches)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += sum(int(line.split()[1]) for line in status.read_text().splitlines()
                         if line.startswith("voluntary_ctxt_switches:"))
    return total
