"""common/heap.py: what a started process holds leaves the garbage collector's passes."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import gc
import api.app  # the API's modules, as a started process holds them
from common.heap import freeze_startup_heap
before = gc.get_freeze_count()
freeze_startup_heap()
frozen = gc.get_freeze_count()
young = [object() for _ in range(10)]
print(before, frozen, len(gc.get_objects(generation=2)), gc.get_freeze_count() == frozen)
"""


def test_freezing_moves_the_started_heap_out_of_the_collectors_passes() -> None:
    # In a child process: freezing the test process's own heap would keep its garbage for good.
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, timeout=120)
    before, frozen, oldest, unchanged = out.stdout.split()
    assert int(before) == 0 and int(frozen) > 50_000  # the modules' objects, frozen
    assert int(oldest) < int(frozen) / 10  # what the full passes still walk is a small rest
    assert unchanged == "True"  # objects made afterwards are the collector's as before
