"""A 202 is a promise that outlives Redis: accepted jobs survive Redis being killed (-9) or shut
down and restarted on its port and data directory, the API answers 503 with Retry-After in the gap,
and the worker finishes what it was running. The Redis here is the project's own (the embedded
one `openjev serve` runs), a local process this module kills for real."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from api.queue_client import AppendOnlyFile
from common.queue import keys
from harness.aof import in_file, start_stress
from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.stacks import CPU_MODEL_NAME, answered, final_statuses, stack_env
from harness.web import web
from openjev.embedded_redis import PORT_FLOOR, RedisServer, ephemeral_ports, free_port
from tests.test_api_contract import NOUL, body
from tests.test_faults import Served, descendants, start_serve, stop_serve

pytestmark = pytest.mark.integration

JOBS = 50
RUNNING_AT_ONCE = 4  # the worker's slots: the rest of the jobs wait in its queue
ENGINE_DELAY = 1.0  # seconds each engine call stalls while jobs are submitted: most are still queued at the kill


class DurableStack:
    """Redis on its own data directory, the scripted engine, one worker and an API."""

    def __init__(self, data_dir: Path, log_dir: Path, model_dir: Path) -> None:
        self.redis = RedisServer.on(data_dir)
        self.redis.start()
        self.redis.wait_ready()
        self.engine = start_scripted_engine(log_dir)
        assert self.engine.url
        env = stack_env(self.redis.url, model_dir, OPENJEV_MAX_CONCURRENT_REQUESTS=str(RUNNING_AT_ONCE),
                        OPENJEV_JOB_TIMEOUT="300")
        self.worker = start_worker(log_dir, env, self.engine.url, "w-durable")
        self.api = start_api(log_dir, env)
        assert self.api.url
        self.url = self.api.url

    def script(self, **settings: Any) -> None:
        assert self.engine.url
        web.post(f"{self.engine.url}/script", json=settings, timeout=5).raise_for_status()

    def engine_stats(self) -> dict[str, Any]:
        return web.get(f"{self.engine.url}/stats", timeout=5).json()

    def stop(self) -> None:
        for proc in (self.api, self.worker, self.engine):
            proc.stop()
        self.redis.stop()


@pytest.fixture
def durable(tmp_path: Path, log_dir: Path, model_dir: Path) -> Iterator[DurableStack]:
    stack = DurableStack(tmp_path / "redis", log_dir, model_dir)
    yield stack
    stack.stop()


def submit_all(stack: DurableStack, count: int) -> list[str]:
    def submit(i: int) -> str:
        response = web.post(stack.url + "/v1/jobs", json=body({"q": NOUL}, state=f"Ticket {i}: refund?"),
                            timeout=30)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(submit, range(count)))


def wait_running(stack: DurableStack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not stack.engine_stats()["live"]:
        assert time.monotonic() < deadline, "no job reached the engine"
        time.sleep(0.05)


def statuses(stack: DurableStack, job_ids: list[str]) -> dict[str, int]:
    client = redis.Redis.from_url(stack.redis.url)
    try:
        found: dict[str, int] = {}
        for job_id in job_ids:
            status = (client.hget(keys.job_key(job_id), "status") or b"missing").decode()
            found[status] = found.get(status, 0) + 1
        return found
    finally:
        client.close()


def outcomes(stack: DurableStack, job_ids: list[str], timeout: float = 180.0) -> dict[str, int]:
    """Each job's final status (GET ?wait= until it ends), counted; 503s while Redis returns are retried."""
    return Counter(final_statuses(stack.url, job_ids, timeout))


def assert_gap_answers_503_fast(stack: DurableStack) -> None:
    """What a client sees while Redis is down: a quick 503 with Retry-After, never a 500 or a hang."""
    for path in ("/v1/jobs", "/v1/systemone"):
        started = time.monotonic()
        response = web.post(stack.url + path, json=body({"q": NOUL}), timeout=30)
        assert time.monotonic() - started < 5.0
        assert response.status_code == 503, response.text
        assert response.json()["detail"]["error_type"] == "unavailable_error"
        assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM], ids=["kill -9", "clean shutdown"])
def test_accepted_jobs_are_all_answered_after_redis_restarts_on_its_data_dir(
        durable: DurableStack, stop_signal: signal.Signals) -> None:
    durable.script(delay=ENGINE_DELAY)
    job_ids = submit_all(durable, JOBS)
    wait_running(durable)
    before = statuses(durable, job_ids)
    assert before.get("running", 0) >= 1 and before.get("queued", 0) >= JOBS // 2, before

    assert durable.redis.process is not None
    durable.redis.process.send_signal(stop_signal)
    durable.redis.process.wait(30)
    assert_gap_answers_503_fast(durable)
    durable.redis.start()  # same port, same data directory, same password
    durable.redis.wait_ready()
    durable.script(delay=0.05)

    assert outcomes(durable, job_ids) == {"succeeded": JOBS}
    assert durable.worker.alive() and durable.api.alive()  # rode through the restart: nothing was restarted


def test_an_async_jobs_202_comes_once_its_job_is_in_the_append_only_file(
        durable: DurableStack, tmp_path: Path) -> None:
    """Under a disk busy with fsyncs, Redis acknowledges some writes before they are in its file (the
    window a kill -9 loses: bench/aof_window.py measured 4–10 % of them); the API's 202 waits them out."""
    durable.script(delay=ENGINE_DELAY)  # the jobs stay queued: the file holds their placement, not their end
    stress = start_stress(tmp_path)
    try:
        for i in range(60):
            response = web.post(durable.url + "/v1/jobs", json=body({"q": NOUL}, state=f"Ticket {i}: refund?"),
                                timeout=30)
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
            assert in_file(durable.redis.data_dir, keys.job_key(job_id).encode()), f"202 for job {i} before its write"
    finally:
        os.killpg(stress.pid, signal.SIGKILL)
        stress.wait()


def test_without_an_append_only_file_or_info_a_job_is_acknowledged_at_once(durable: DurableStack) -> None:
    """A Redis without an AOF, or one that refuses INFO (a managed Redis's ACL), has no file to wait
    for: AppendOnlyFile.wait says so at once, and the API still answers 202."""
    async def wait(url: str) -> tuple[bool, bool, float]:
        client = AsyncRedis.from_url(url)
        written = AppendOnlyFile(client)
        try:
            started = time.monotonic()
            return await written.wait(), written.readable, time.monotonic() - started
        finally:
            await client.aclose()

    owner = redis.Redis.from_url(durable.redis.url)
    try:
        assert asyncio.run(wait(durable.redis.url))[:2] == (True, True)  # the stack's own: AOF on, INFO allowed
        owner.acl_setuser("no-info", enabled=True, passwords=["+secret-of-the-test"], keys=["*"], channels=["*"],
                          commands=["+@all", "-info"])
        refused = asyncio.run(wait(f"redis://no-info:secret-of-the-test@127.0.0.1:{durable.redis.port}/0"))
        assert refused[:2] == (False, False) and refused[2] < 1.0
        owner.config_set("appendonly", "no")
        assert asyncio.run(wait(durable.redis.url))[:2] == (False, True)
        response = web.post(durable.url + "/v1/jobs", json=body({"q": NOUL}), timeout=30)
        assert response.status_code == 202, response.text
    finally:
        owner.close()


# --- under `openjev serve`: its own Redis --------------------------------------------------------


def serve_redis(served: Served) -> tuple[int, str]:
    """The pid of serve's redis-server and its command line as `ps` shows it: "redis-server 127.0.0.1:PORT"
    once Redis has set its title, the argv serve started it with ("... --port PORT ...") until then."""
    (found,) = [(pid, cmd) for pid, cmd in descendants(served.process.pid).items() if "redis-server" in cmd]
    return found


def port_of(redis_title: str) -> int:
    words = redis_title.split()
    if "--port" in words:  # a Redis just started has not rewritten its title yet
        return int(words[words.index("--port") + 1])
    return int(words[1].rsplit(":", 1)[1])


def persistence(port: int, redis_dir: Path) -> dict[str, str]:
    """The settings that make it durable, as the running server reports them (with its password)."""
    owner = redis.Redis(port=port, password=(redis_dir / "password").read_text().strip())
    try:
        return {k: v for name in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy", "protected-mode", "dir",
                                  "save", "bind", "hz") for k, v in owner.config_get(name).items()}
    finally:
        owner.close()


def start_connected_serve(log_dir: Path, engine: Proc, model_dir: Path, redis_dir: Path, **env: str) -> Served:
    assert engine.url
    return start_serve(log_dir, "--connect", engine.url, OPENJEV_TOKENIZER=str(model_dir),
                       OPENJEV_SERVED_MODEL_NAME=CPU_MODEL_NAME, OPENJEV_REDIS_DIR=str(redis_dir), **env)


@pytest.fixture
def engine(log_dir: Path) -> Iterator[Proc]:
    proc = start_scripted_engine(log_dir)
    yield proc
    proc.stop()


def test_serve_restarts_its_redis_in_place_and_the_stack_keeps_answering(
        engine: Proc, model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    redis_dir = tmp_path / "redis"
    served = start_connected_serve(log_dir, engine, model_dir, redis_dir, OPENJEV_REDIS_MAXMEMORY="768mb")
    try:
        password = (redis_dir / "password").read_text().strip()
        pid, title = serve_redis(served)
        port = port_of(title)
        web.post(f"{engine.url}/script", json={"delay": 2.0}, timeout=5).raise_for_status()
        job = web.post(served.url + "/v1/jobs", json=body({"q": NOUL}), timeout=30).json()

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while serve_redis_if_up(served) in (None, pid):
            assert time.monotonic() < deadline, "serve did not restart its Redis"
            time.sleep(0.1)
        assert port_of(serve_redis(served)[1]) == port  # in place: the same port, data directory and password
        kept = persistence(port, redis_dir)
        assert (kept["dir"], kept["maxmemory"]) == (str(redis_dir), str(768 * 2**20))  # the setting's, kept

        web.post(f"{engine.url}/script", json={"delay": 0.0}, timeout=5).raise_for_status()
        response = answered(served.url, body({"q": NOUL}))  # past the 503s of the restart
        assert response.status_code == 200, response.text
        final = web.get(f"{served.url}/v1/jobs/{job['id']}", params={"wait": 20}, timeout=40).json()
        assert final.get("status") == "succeeded", final  # accepted before the kill, answered after it
        assert served.process.poll() is None
        assert "redis exited with -9; restarting it (in place" in served.output()
    finally:
        stop_serve(served)
    assert password not in served.output()  # never in a log, nor in a printed URL
    assert password not in title  # nor on Redis's command line, which every local user can read

    again = start_connected_serve(log_dir, engine, model_dir, redis_dir)  # the same data dir, a new serve
    try:
        kept = web.get(f"{again.url}/v1/jobs/{job['id']}", timeout=30).json()
        assert kept["status"] == "succeeded"  # the jobs outlive serve itself
        assert (redis_dir / "password").read_text().strip() == password
    finally:
        stop_serve(again)


def test_free_ports_come_from_below_the_range_outgoing_connections_take_theirs() -> None:
    """A server's port is chosen, then bound later (SGLang ~30 s later, a restarted Redis after a
    crash): a port from the ephemeral range can meanwhile become some outgoing connection's local
    port, and the bind fails (a CI run's SGLang did, then hung). free_port picks below that range."""
    low, high = ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    assert all(PORT_FLOOR <= port < low for port in ports), ports
    assert len(set(ports)) > 1  # chosen at random, not handed out in order
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname(), timeout=5) as outgoing:
            assert low <= outgoing.getsockname()[1] <= high  # where the kernel takes local ports from


def serve_redis_if_up(served: Served) -> int | None:
    found = [pid for pid, cmd in descendants(served.process.pid).items() if "redis-server" in cmd]
    return found[0] if found else None


def test_serves_redis_refuses_unauthenticated_commands_and_keeps_its_password_private(
        engine: Proc, model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    redis_dir = tmp_path / "redis"
    served = start_connected_serve(log_dir, engine, model_dir, redis_dir)
    try:
        port = port_of(serve_redis(served)[1])
        for password in (None, "guessed"):
            client = redis.Redis(port=port, password=password, socket_timeout=5)
            with pytest.raises(redis.AuthenticationError):
                client.execute_command("CONFIG", "SET", "dir", str(tmp_path))  # the file-writing attack
            with pytest.raises(redis.AuthenticationError):
                client.keys("*")
            client.close()
        assert stat.S_IMODE((redis_dir / "password").stat().st_mode) == 0o600
        assert stat.S_IMODE(redis_dir.stat().st_mode) == 0o700

        assert persistence(port, redis_dir) == {
            "appendonly": "yes", "appendfsync": "everysec", "maxmemory": str(2**30), "maxmemory-policy": "noeviction",
            "protected-mode": "yes", "dir": str(redis_dir), "save": "", "bind": "127.0.0.1",
            "hz": "1"}  # its timer at 1 Hz: quiet at rest

        second = start_serve_expecting_failure(log_dir, engine, model_dir, redis_dir)
        assert "another Redis runs on" in second  # one Redis per data directory, said plainly
    finally:
        stop_serve(served)


def start_serve_expecting_failure(log_dir: Path, engine: Proc, model_dir: Path, redis_dir: Path) -> str:
    assert engine.url
    done = subprocess.run([sys.executable, "-m", "openjev", "serve", "--port", str(free_port()), "--connect",
                           engine.url], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENJEV_TOKENIZER": str(model_dir), "OPENJEV_REDIS_DIR": str(redis_dir),
                               "OPENJEV_SERVED_MODEL_NAME": CPU_MODEL_NAME})
    assert done.returncode != 0
    return done.stderr
