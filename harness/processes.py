"""Real processes for tests: start a command, wait until it answers HTTP, stop it by its pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

import httpx

from harness.procfs import listens_on
from harness.web import web
from openjev.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A child process the test started, with its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path, health: str | None = None,
          timeout: float = 120.0) -> Proc:
    """Start `argv` with `env` added to ours; wait for `health` to answer 200 if given."""
    log = log_dir / f"{name}-{time.monotonic_ns()}.log"
    handle = log.open("wb")
    process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    proc = Proc(name, process, log, env=env)
    if health:
        wait_http(proc, health, timeout)
    return proc


def wait_http(proc: Proc, url: str, timeout: float, status: int = 200) -> None:
    """Until `url` answers `status` from `proc` itself: a server that binds its port late (the CPU engine, after
    loading its model) may find another test's server answering there meanwhile, which does not count."""
    port = urlsplit(url).port
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.output()[-4000:]}")
        try:
            if web.get(url, timeout=2.0).status_code == status and (
                    port is None or listens_on(proc.process.pid, port)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{proc.name} not ready at {url} within {timeout} s:\n{proc.output()[-4000:]}")


def openjev(*args: str) -> list[str]:
    return [sys.executable, "-m", "openjev", *args]


def start_scripted_engine(log_dir: Path) -> Proc:
    port = free_port()
    proc = spawn("scripted-engine", [sys.executable, "-m", "harness.scripted_engine", "--port", str(port)], {},
                 log_dir, health=f"http://127.0.0.1:{port}/health")
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def start_cpu_engine(log_dir: Path, cache_dir: Path, compute_delay: float = 0.0, dtype: str | None = None) -> Proc:
    """`dtype`: the engine's OPENJEV_CPU_DTYPE (default: this process's, float32 under pytest)."""
    port = free_port()
    proc = spawn("cpu-engine", openjev("engine", "--port", str(port), "--cache-dir", str(cache_dir),
                                       "--compute-delay", str(compute_delay)),
                 {"OPENJEV_CPU_DTYPE": dtype} if dtype else {}, log_dir, health=f"http://127.0.0.1:{port}/health",
                 timeout=600)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def start_worker(log_dir: Path, env: dict[str, str], engine_url: str, worker_id: str) -> Proc:
    return spawn(f"worker-{worker_id}", openjev("worker"),
                 {**env, "OPENJEV_ENGINE_URL": engine_url, "OPENJEV_WORKER_ID": worker_id}, log_dir)


def start_api(log_dir: Path, env: dict[str, str], wait_ready: bool = True) -> Proc:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn("api", openjev("api", "--port", str(port)), env, log_dir,
                 health=f"{url}/health" if wait_ready else f"{url}/health/live", timeout=180)
    proc.url = url
    return proc


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class BackgroundSampler:
    """Calls `sample()` every `interval` seconds on a daemon thread while its `with` block runs, then
    `close()`; subclasses keep what they sample."""

    interval = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.close()

    def sample(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the samples used (nothing, unless a subclass holds a connection)."""

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
