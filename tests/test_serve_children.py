"""serve stops what it started: a child started as its own process group (SGLang, which forks its
scheduler and detokenizer) is stopped with every process it forked, even when its leader exits first.
And each child gets only the secrets it needs."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from harness.processes import alive
from openjev.embedded_redis import free_port
from openjev.serve import Child, child_env
from tests.test_serve_smoke import _kill, descendants, start_serve, wait_for_url

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
        time.sleep(0.5)  # a negative check's window: a grandchild stopped with its parent would be gone by now
        assert alive(grandchild)
    finally:
        if alive(grandchild):
            os.kill(grandchild, 9)


SECRETS = {"OPENJEV_API_KEY": "client-key-123", "OPENJEV_BACKEND_API_KEY": "engine-key-456",
           "OPENJEV_JOB_ID_SECRET": "job-id-secret-789"}


def test_each_child_role_keeps_only_its_secrets() -> None:
    env = {**SECRETS, "OPENJEV_REDIS_URL": "redis://:pw@127.0.0.1:1/0", "openjev_api_key": "lower", "PATH": "/bin"}
    assert set(child_env("api", env)) == {"OPENJEV_API_KEY", "openjev_api_key", "OPENJEV_JOB_ID_SECRET",
                                          "OPENJEV_REDIS_URL", "PATH"}
    assert set(child_env("worker", env)) == {"OPENJEV_BACKEND_API_KEY", "OPENJEV_REDIS_URL", "PATH"}
    assert set(child_env("engine", env)) == {"OPENJEV_BACKEND_API_KEY", "PATH"}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def role_of(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return next((arg.decode() for arg in argv if arg in (b"api", b"worker", b"engine")), None)


@pytest.mark.integration
def test_serve_gives_the_engine_no_key_or_redis_password_and_the_worker_no_api_key(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    serve = start_serve(log, "--port", str(free_port()), env=SECRETS)
    children: set[int] = set()
    try:
        wait_for_url(serve, log)
        children = descendants(serve.pid)
        envs = {role: environ(pid) for pid in children if (role := role_of(pid))}
        assert set(envs) == {"api", "worker", "engine"}, envs.keys()
        password = envs["api"]["OPENJEV_REDIS_URL"].split("@")[0].rsplit(":", 1)[1]
        assert len(password) >= 16  # the embedded Redis's own
        assert envs["api"]["OPENJEV_API_KEY"] == "client-key-123"
        assert "OPENJEV_BACKEND_API_KEY" not in envs["api"]
        assert password in envs["worker"]["OPENJEV_REDIS_URL"]
        assert "OPENJEV_API_KEY" not in envs["worker"] and "OPENJEV_JOB_ID_SECRET" not in envs["worker"]
        engine = "\0".join(f"{name}={value}" for name, value in envs["engine"].items())
        for secret in (password, "client-key-123", "job-id-secret-789"):
            assert secret not in engine
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        _kill(serve, children)
