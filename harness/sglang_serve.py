"""`openjev serve --sglang-python` as a test or a benchmark starts it: SGLang 0.5.23 on the CPU with
SmolLM2-135M-Instruct, through the production launcher, and stopped by pid with everything it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.processes import alive
from harness.procfs import listens_on
from harness.stacks import CPU_MODEL_NAME, model_cache_dir
from harness.web import web
from openjev.embedded_redis import PASSWORD_FILE, free_port

START_TIMEOUT = 1800.0  # a cold start takes about 2 minutes alone; over 15 on a machine loaded 20-fold
REQUEST_TIMEOUT = 600.0  # the API's deadline here: a 255-option prefill on a busy shared CPU takes minutes


def sglang_python() -> str:
    """The SGLang interpreter; a skip (or, under OPENJEV_REQUIRE_SGLANG=1, a failure) without one."""
    path = os.environ.get("OPENJEV_TEST_SGLANG_PYTHON", "")
    if path and Path(path).exists():
        return path
    reason = (f"OPENJEV_TEST_SGLANG_PYTHON={path!r} is not an interpreter: install SGLang with "
              "deploy/install_sglang_cpu.sh and point the variable at .cache/sglang-venv/bin/python")
    if os.environ.get("OPENJEV_REQUIRE_SGLANG") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class SglangServe:
    """A running `openjev serve --sglang-python`: its API, and the SGLang and Redis it started."""

    frontend: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str  # the API
    engine_url: str = ""  # SGLang itself
    redis_url: str = ""
    redis_dir: Path | None = None
    cold_start_s: float = 0.0
    descendants: set[int] = field(default_factory=set)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def post(self, body: Any, path: str = "/v1/systemone", **kwargs: Any) -> httpx.Response:
        return web.post(self.url + path, json=body, timeout=kwargs.pop("timeout", REQUEST_TIMEOUT + 30), **kwargs)

    def sglang_metric(self, name: str) -> float:
        """The sum of one counter over its label sets in SGLang's own /metrics."""
        text = web.get(self.engine_url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def start_sglang_serve(frontend: str, python: str, model_dir: Path, log_dir: Path,
                       redis_dir: Path | None = None) -> SglangServe:
    """`redis_dir`: the embedded Redis's directory (a restart passes its predecessor's); default, a new one."""
    port = free_port()
    log = log_dir / f"serve-sglang-{frontend}-{time.monotonic_ns()}.log"
    redis_dir = redis_dir or log.with_suffix(".redis")
    env = {**os.environ, "OPENJEV_CACHE_DIR": str(model_cache_dir().parent), "OPENJEV_MODEL": str(model_dir),
           "OPENJEV_SERVED_MODEL_NAME": CPU_MODEL_NAME, "OPENJEV_FRONTEND": frontend,
           "OPENJEV_SGLANG_DEVICE": "cpu", "OPENJEV_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
           "OPENJEV_REDIS_DIR": str(redis_dir)}
    env.pop("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", None)  # /health runs its one-token generation
    started = time.monotonic()
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "openjev", "serve", "--port", str(port),
                                    "--sglang-python", python], env=env, stdout=handle, stderr=subprocess.STDOUT)
    served = SglangServe(frontend, process, log, f"http://127.0.0.1:{port}")
    try:
        _wait_ready(served)
    except BaseException:  # not ready, or interrupted: never leave SGLang running behind
        stop_sglang_serve(served)
        raise
    served.cold_start_s = time.monotonic() - started
    served.engine_url = _logged(served, r"engine-0 ready at (http://\S+)")
    # serve logs its Redis's address without the password; that is in the data directory, 0600.
    served.redis_dir = redis_dir
    password = (redis_dir / PASSWORD_FILE).read_text().strip()
    served.redis_url = _logged(served, r"embedded Redis on (redis://\S+)").replace("redis://", f"redis://:{password}@")
    served.descendants = _descendants(process.pid)
    return served


def stop_sglang_serve(served: SglangServe) -> list[int]:
    """Stop serve (it stops SGLang, the worker, the API and Redis); kill by pid whatever it left
    running, and return those pids (none, when serve cleans up as it should)."""
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
        try:
            served.process.wait(60)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()
    left = sorted(pid for pid in served.descendants if alive(pid))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _wait_ready(served: SglangServe) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if served.process.poll() is not None:
            raise AssertionError(f"serve exited with {served.process.returncode}:\n{served.output()[-6000:]}")
        try:
            if web.get(served.url + "/health", timeout=2).status_code == 200 and listens_on(
                    served.process.pid, int(served.url.rsplit(":", 1)[1])):  # serve's own API, not another's
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"serve with SGLang not ready within {START_TIMEOUT:g} s:\n{served.output()[-6000:]}")


def _logged(served: SglangServe, pattern: str) -> str:
    match = re.search(pattern, served.output())
    assert match, f"serve did not log {pattern!r}:\n{served.output()[-3000:]}"
    return match.group(1)


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = Path(f"/proc/{parent}/task/{parent}/children")
        try:
            kids = [int(c) for c in children.read_text().split()]
        except OSError:
            continue
        found.update(kids)
        frontier.extend(kids)
    return found


