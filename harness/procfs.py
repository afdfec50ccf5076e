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


LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp when it listens


def listens_on(pid: int, port: int) -> bool:
    """True when `pid`, or a process it started, holds a TCP socket listening on `port`: that a server
    answering there is the one a test started, and not another test's that took the port meanwhile."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    if not inodes:
        return False
    for process in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):  # a process that just ended
            for fd in os.listdir(f"/proc/{process}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{process}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes:
                        return True
    return False


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
