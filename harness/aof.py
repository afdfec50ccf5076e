"""Redis's append-only file, seen from outside: whether a key has reached it, and a process that keeps
the disk's fsyncs slow (the window in which Redis acknowledges writes it has not yet written)."""

from __future__ import annotations

import subprocess
from pathlib import Path

STRESS_MB = 64  # written and fsynced over and over by the stress process


def in_file(data_dir: Path, key: bytes) -> bool:
    """Whether `key` is in the append-only file (Redis 6's one file, or 7's directory of them)."""
    return any(key in path.read_bytes() for path in data_dir.rglob("*.aof"))


def start_stress(directory: Path) -> subprocess.Popen[bytes]:
    script = (f"while true; do dd if=/dev/zero of={directory / 'stress'} bs=1M count={STRESS_MB} conv=fsync "
              "status=none; done")
    return subprocess.Popen(["bash", "-c", script], start_new_session=True)
