"""serve stops what it started: a child started as its own process group (SGLang, which forks its
scheduler and detokenizer) is stopped with every process it forked, even when its leader exits first."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from openjev.serve import Child
from tests.processes import alive

# A leader that forks a long-lived grandchild, reports its pid, and exits at once on SIGTERM
# (as SGLang's launcher can while its scheduler is still alive).
LEADER = """
import os, signal, subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
signal.pause()
"""


def started(tmp_path: Path, own_group: bool) -> tuple[Child, int]:
    pid_file = tmp_path / f"grandchild-{own_group}"
    child = Child("engine-0", [sys.executable, "-c", LEADER, str(pid_file)], dict(os.environ), own_group=own_group)
    child.start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the leader never forked"
        time.sleep(0.05)
    return child, int(pid_file.read_text())


def test_a_child_in_its_own_group_is_stopped_with_the_processes_it_forked(tmp_path: Path) -> None:
    child, grandchild = started(tmp_path, own_group=True)
    assert child.process is not None and os.getpgid(child.process.pid) == child.process.pid
    child.stop(timeout=10)
    assert child.process.returncode is not None
    deadline = time.monotonic() + 10
    while alive(grandchild):
        assert time.monotonic() < deadline, f"grandchild {grandchild} outlived its stopped group"
        time.sleep(0.05)


def test_without_its_own_group_only_the_leader_is_stopped(tmp_path: Path) -> None:
    # What serve did before: the grandchild survives its parent (so the group is what makes the difference).
    child, grandchild = started(tmp_path, own_group=False)
    try:
        child.stop(timeout=10)
        time.sleep(0.5)
        assert alive(grandchild)
    finally:
        if alive(grandchild):
            os.kill(grandchild, 9)
