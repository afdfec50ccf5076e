"""What CI checks of a deployment: `openjev smoke` passes against a real `openjev serve`, and serve
stops on SIGTERM with exit 0, taking Redis, the engine, the worker and the API down with it. The same
with `--sglang-python`, where a stand-in interpreter records the SGLang command and serves the scripted
engine in its place."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.processes import ROOT, alive
from harness.redis_servers import fresh_redis
from harness.stacks import CPU_MODEL_NAME, model_cache_dir
from harness.web import web
from openjev.embedded_redis import free_port

SERVE_START_TIMEOUT = 600.0  # a first run converts the CPU model
SERVING_LINE = re.compile(r"openjev is serving on (http://\S+)")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, read from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found



def start_serve(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "OPENJEV_CACHE_DIR": str(model_cache_dir().parent),
                "OPENJEV_REDIS_DIR": str(log.with_suffix(".redis")), **(env or {})}
    with log.open("wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "openjev", "serve", *args], stdout=handle,
                                stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)


def wait_for_url(serve: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + SERVE_START_TIMEOUT
    while time.monotonic() < deadline:
        match = SERVING_LINE.search(log.read_text(errors="replace"))
        if match:
            return match.group(1)
        if serve.poll() is not None:
            pytest.fail(f"openjev serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"openjev serve printed no URL within {SERVE_START_TIMEOUT:g} s:\n{log.read_text()[-4000:]}")


def smoke_argv(url: str, out: Path) -> list[str]:
    """`openjev smoke` as a user runs it; run_smoke directly while the CLI does not offer it yet."""
    from openjev.cli import _parser

    options = ["--allow-weak-model", "--out", str(out), "--startup-timeout", "120"]
    try:
        _parser().parse_args(["smoke", url, *options])
    except SystemExit:
        call = f"run_smoke({url!r}, allow_weak_model=True, out={str(out)!r}, startup_timeout=120)"
        return [sys.executable, "-c", f"import sys; from openjev.smoke import run_smoke; sys.exit({call})"]
    return [sys.executable, "-m", "openjev", "smoke", url, *options]


@pytest.mark.integration
def test_smoke_passes_against_openjev_serve_and_serve_stops_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    serve = start_serve(log, "--port", str(free_port()))
    children: set[int] = set()
    try:
        url = wait_for_url(serve, log)
        children = descendants(serve.pid)
        assert len(children) >= 4, children  # Redis, the engine, a worker and the API
        out = tmp_path / "smoke-result.json"
        smoke = subprocess.run(smoke_argv(url, out), capture_output=True, text=True, cwd=ROOT, timeout=900)
        assert smoke.returncode == 0, smoke.stdout + smoke.stderr
        assert json.loads(out.read_text())["passed"] is True

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert not [pid for pid in children if alive(pid)]
    finally:
        _kill(serve, children)


def _kill(serve: subprocess.Popen[bytes], children: set[int]) -> None:
    # Only on failure: whatever this test started must not outlive it.
    if serve.poll() is None:
        serve.kill()
        serve.wait()
    for pid in children:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


FAKE_SGLANG = """#!{python}
# Stands in for an interpreter with SGLang installed: answers the version probe, records the launch
# command and environment, waits for the test's go-ahead, then serves the scripted engine on --port.
import json, os, pathlib, sys, time
if sys.argv[1] == "-c":
    print("0.5.19")
    raise SystemExit(0)
record = pathlib.Path({record!r})
record.write_text(json.dumps({{"argv": sys.argv[1:], "rust": os.environ.get("SGLANG_RUST_SERVER")}}))
while not pathlib.Path({release!r}).exists():
    time.sleep(0.1)
port = sys.argv[sys.argv.index("--port") + 1]
os.execv(sys.executable, [sys.executable, "-m", "harness.scripted_engine", "--port", port])
"""


@pytest.fixture
def shared_redis() -> Iterator[str]:
    with fresh_redis() as url:
        yield url


@pytest.mark.integration
def test_serve_with_sglang_answers_503_until_ready_then_passes_smoke(tmp_path: Path, shared_redis: str,
                                                                     model_dir: Path) -> None:
    record, release, log = tmp_path / "sglang.json", tmp_path / "release", tmp_path / "serve.log"
    fake = tmp_path / "python"
    fake.write_text(FAKE_SGLANG.format(python=sys.executable, record=str(record), release=str(release)))
    fake.chmod(0o755)
    port = free_port()
    env = {"OPENJEV_REDIS_URL": shared_redis, "OPENJEV_TOKENIZER": str(model_dir), "OPENJEV_FRONTEND": "rust",
           "OPENJEV_SERVED_MODEL_NAME": CPU_MODEL_NAME, "OPENJEV_WORKER_ID": "replica-a"}
    serve = start_serve(log, "--port", str(port), "--sglang-python", str(fake), "--shared-redis",
                        "--", "--mem-fraction-static", "0.8", env=env)
    children: set[int] = set()
    try:
        # The API is up before SGLang is: 503 with Retry-After, not a closed port.
        starting = _wait_for_status(serve, log, f"http://127.0.0.1:{port}/health", 503)
        assert starting.headers["retry-after"]
        launched = json.loads(record.read_text())
        assert launched["argv"][-2:] == ["--mem-fraction-static", "0.8"] and launched["rust"] == "1"
        release.touch()
        url = wait_for_url(serve, log)
        children = descendants(serve.pid)
        health = web.get(f"{url}/health", timeout=10).json()
        assert [w["id"] for w in health["workers"]] == ["replica-a-0"]  # unique per replica on a shared Redis
        smoke = subprocess.run(smoke_argv(url, tmp_path / "smoke.json"), capture_output=True, text=True, cwd=ROOT,
                               timeout=600)
        assert smoke.returncode == 0, smoke.stdout + smoke.stderr
        assert not [pid for pid in children if "redis-server" in _cmdline(pid)]  # the shared one, not its own
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        release.touch()
        _kill(serve, children)


def _wait_for_status(serve: subprocess.Popen[bytes], log: Path, url: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            pytest.fail(f"openjev serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}")
        try:
            response = web.get(url, timeout=5)
            if response.status_code == status:
                return response
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} never answered {status}:\n{log.read_text()[-4000:]}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
