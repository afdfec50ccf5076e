"""`openjev serve` on a terminal: it says what it is loading while it starts, prints a try line that works
from any directory (with the key's header, never the key), and Ctrl-C or SIGTERM stops the whole stack
within 10 s with exit 0 and no traceback, at rest and with a request in flight. Real processes: the
signals and the terminal are what is tested."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.processes import ROOT, alive
from harness.stacks import model_cache_dir
from harness.web import web
from openjev.embedded_redis import free_port
from tests.conftest import FIGURES
from tests.test_serve_smoke import descendants, wait_for_url

STOP_WITHIN = 10.0
TRY_LINE = re.compile(r"try: (curl .*)")


def start_serve(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """serve as a terminal runs it: the leader of its own process group, which a Ctrl-C signals whole."""
    full_env = {**os.environ, "OPENJEV_CACHE_DIR": str(model_cache_dir().parent),
                "OPENJEV_REDIS_DIR": str(log.with_suffix(".redis")), **(env or {})}
    with log.open("wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "openjev", "serve", "--port", str(free_port()), *args],
                                stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd="/", start_new_session=True)


def stop_and_time(serve: subprocess.Popen[bytes], send) -> float:
    started = time.monotonic()
    send()
    try:
        assert serve.wait(timeout=STOP_WITHIN + 20) == 0
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    return time.monotonic() - started


def assert_quiet_and_gone(log: Path, children: set[int], seconds: float) -> None:
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "CancelledError" not in text, text[-4000:]
    assert seconds < STOP_WITHIN, f"serve took {seconds:.1f} s to stop"
    assert not [pid for pid in children if alive(pid)]


def kill_leftovers(serve: subprocess.Popen[bytes], children: set[int]) -> None:
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()
    for pid in children:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
def test_ctrl_c_stops_serve_quietly_and_the_start_said_what_it_loaded(tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    log = tmp_path / "serve.log"
    started = time.monotonic()
    serve = start_serve(log)
    children: set[int] = set()
    try:
        url = wait_for_url(serve, log)
        start_seconds = time.monotonic() - started
        children = descendants(serve.pid)
        assert len(children) >= 4, children
        text = log.read_text(errors="replace")
        assert re.search(r"starting engine-0 \(the CPU engine: (loads|converts) smollm2-135m", text), text
        assert "starting api (the HTTP API: loads the tokenizer" in text
        command = TRY_LINE.search(text)
        assert command and "Authorization" not in command.group(1)
        # The try line works as printed from another directory (serve ran in /).
        answered = subprocess.run(shlex.split(command.group(1)), capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path)
        assert answered.returncode == 0 and '"answers"' in answered.stdout, answered.stdout + answered.stderr
        assert command.group(1).startswith(f"curl -s {url}/v1/systemone")
        # The README's first request, which it says the default model gets right.
        answers = json.loads(answered.stdout)["answers"]
        assert "first-request.json" in command.group(1)
        assert answers["department"]["choice"] == "Sales" and answers["sales_inquiry"]["noul"] > 0.5
        assert max(answers["urgency"]["probabilities"], key=answers["urgency"]["probabilities"].get) == "0"

        seconds = stop_and_time(serve, lambda: os.killpg(serve.pid, signal.SIGINT))  # the terminal's Ctrl-C
        assert_quiet_and_gone(log, children, seconds)
        request.config.stash.setdefault(FIGURES, []).append(
            f"openjev serve (SmolLM2 converted): serving after {start_seconds:.1f} s, Ctrl-C at rest: {seconds:.1f} s")
    finally:
        kill_leftovers(serve, children)


@pytest.mark.integration
def test_sigterm_with_a_request_in_flight_stops_within_10_s_and_the_try_line_names_the_key_variable(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    log = tmp_path / "serve.log"
    key = "k-" + os.urandom(8).hex()
    serve = start_serve(log, "--compute-delay", "60", env={"OPENJEV_API_KEY": key})
    children: set[int] = set()
    try:
        url = wait_for_url(serve, log)
        children = descendants(serve.pid)
        text = log.read_text(errors="replace")
        assert key not in text
        command = TRY_LINE.search(text)
        assert command and '-H "Authorization: Bearer $OPENJEV_API_KEY"' in command.group(1)
        answered = subprocess.run(["bash", "-c", command.group(1)], capture_output=True, text=True, timeout=30,
                                  env={**os.environ, "OPENJEV_API_KEY": "wrong"})
        assert '"authentication_error"' in answered.stdout  # the header is sent, with the variable's value

        headers = {"Authorization": f"Bearer {key}"}
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(_post(url, headers)), daemon=True)
        sender.start()
        deadline = time.monotonic() + 60
        while not any(w["running"] for w in web.get(f"{url}/v1/limits", headers=headers).json()["workers"]):
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.1)

        seconds = stop_and_time(serve, lambda: serve.send_signal(signal.SIGTERM))
        assert_quiet_and_gone(log, children, seconds)
        request.config.stash.setdefault(FIGURES, []).append(
            f"openjev serve: SIGTERM with a request in flight: stopped in {seconds:.1f} s")
        sender.join(timeout=30)
        # The request the API stopped waiting for is told to come again, not dropped or answered 500.
        assert answers and answers[0].status_code == 503, answers and answers[0].text
        assert answers[0].headers["retry-after"] == "1" and "send it again" in answers[0].text
    finally:
        kill_leftovers(serve, children)


def _post(url: str, headers: dict[str, str]) -> httpx.Response:
    body = (ROOT / "examples" / "request.json").read_bytes()
    return web.post(f"{url}/v1/systemone", content=body, timeout=120,
                    headers={**headers, "Content-Type": "application/json"})
