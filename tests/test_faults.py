"""Faults the queue must survive, each with real processes killed for real: a worker SIGKILLed in
the middle of a job, an external Redis stopped and restarted on its port, an engine that dies, no
worker at all; and the same faults under `openjev serve`. Nothing may hang, nothing may answer 500,
and a job never runs on two workers at once (checked from the CPU engine's own counters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from common.queue import keys
from harness.processes import (
    BackgroundSampler,
    Proc,
    alive,
    openjev,
    spawn,
    start_scripted_engine,
    start_worker,
    wait_http,
)
from harness.procfs import listens_on
from harness.stacks import model_cache_dir, stack_env
from harness.web import web
from openjev.embedded_redis import RedisServer, free_port
from tests.conftest import wait_until
from tests.test_logs import events

pytestmark = pytest.mark.integration

REQUEST_TIMEOUT = 20.0  # the API's sync deadline in this module: room for a restart and a re-run
JOB_TIMEOUT = 30.0
COMPUTE_DELAY = 1.5  # seconds the CPU engine stalls each prompt (abortably): a killed job is surely in flight
START_TIMEOUT = 600.0  # model loads on a busy machine are slow; a first run also converts the model
ONE_QUESTION = {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}


def body(state: str) -> dict[str, Any]:
    """One question: a run is a warm call then one branch, so one run never has two prompts live."""
    return {"model": "jev-latest", "state": state, "questions": ONE_QUESTION}


def assert_error_shape(response: httpx.Response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-typesafe-request-id"].startswith("req_")
    assert response.json()["detail"]["error_type"] == error_type


def engine_stats(engine_url: str) -> dict[str, Any]:
    return web.get(f"{engine_url}/stats", timeout=10).json()


def wait_in_flight(engine_url: str, before: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """The engine's counters once a prompt received since `before` is live (stalled in the compute delay)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine_stats(engine_url)
        if stats["requests_received"] > before["requests_received"] and stats["queue_depth"] >= 1:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"no prompt reached the engine within {timeout:g} s")


def settled(engine_url: str, timeout: float = 30.0) -> dict[str, Any]:
    """The engine's counters once nothing is live in it."""
    deadline = time.monotonic() + timeout
    while (stats := engine_stats(engine_url))["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


def delta(after: dict[str, Any], before: dict[str, Any], counter: str) -> int:
    return after[counter] - before[counter]


class DepthWatch(BackgroundSampler):
    """Samples the engine's live prompt count while a test runs. One job with one question never
    has two prompts live, so a maximum above 1 means two workers ran the job at the same time."""

    interval = 0.05

    def __init__(self, engine_url: str) -> None:
        super().__init__()
        self.engine_url = engine_url
        self.max_depth = 0
        self.samples = 0

    def sample(self) -> None:
        try:
            self.max_depth = max(self.max_depth, engine_stats(self.engine_url)["queue_depth"])
            self.samples += 1
        except httpx.HTTPError:
            pass


@dataclass
class FaultStack:
    """Redis, one CPU engine and an API, owned by this module so tests may kill and restart them;
    each test starts (and kills) its own workers."""

    redis: RedisServer
    engine: Proc
    api: Proc
    env: dict[str, str]
    log_dir: Path

    @property
    def url(self) -> str:
        assert self.api.url
        return self.api.url

    @property
    def engine_url(self) -> str:
        assert self.engine.url
        return self.engine.url

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def post(self, payload: dict[str, Any], path: str = "/v1/systemone", timeout: float = 10.0) -> httpx.Response:
        return web.post(self.url + path, json=payload, timeout=timeout)

    def health(self) -> httpx.Response:
        return web.get(self.url + "/health", timeout=10)

    def live_worker_ids(self) -> set[str]:
        return {w["id"] for w in self.health().json()["workers"] if w["engine_ok"]}

    def wait_live(self, *worker_ids: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not set(worker_ids) <= self.live_worker_ids():
            assert time.monotonic() < deadline, f"{worker_ids} not live within {timeout:g} s"
            time.sleep(0.1)

    def job_record(self, job_id: str) -> dict[str, str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return {k.decode(): v.decode() for k, v in client.hgetall(keys.job_key(job_id)).items()}
        finally:
            client.close()

    def stop_redis(self) -> None:
        self.redis.stop()

    def restart_redis(self) -> None:
        """Redis again on the same port, data directory and password."""
        self.redis.start()
        self.redis.wait_ready()


@pytest.fixture(scope="module")
def faults(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    redis_server = RedisServer.on(tmp_path_factory.mktemp("redis"))
    redis_server.start()
    redis_server.wait_ready()
    env = stack_env(redis_server.url, model_dir, OPENJEV_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT),
                    OPENJEV_JOB_TIMEOUT=str(JOB_TIMEOUT))
    engine_port, api_port = free_port(), free_port()
    # Both load a model or tokenizer: start them together, then wait for both.
    engine = spawn("cpu-engine", openjev("engine", "--port", str(engine_port), "--cache-dir", str(model_cache_dir()),
                                         "--compute-delay", str(COMPUTE_DELAY)), {}, log_dir)
    engine.url = f"http://127.0.0.1:{engine_port}"
    api = spawn("api", openjev("api", "--port", str(api_port)), env, log_dir)
    api.url = f"http://127.0.0.1:{api_port}"
    stack = FaultStack(redis_server, engine, api, env, log_dir)
    try:
        wait_http(engine, f"{engine.url}/health", START_TIMEOUT)
        wait_http(api, f"{api.url}/health/live", START_TIMEOUT)
        yield stack
    finally:
        api.stop()
        engine.stop()
        redis_server.stop()


@dataclass
class Workers:
    """Workers a test starts; whatever is still running at the end is stopped cleanly."""

    stack: FaultStack
    started: list[Proc] = field(default_factory=list)

    def start(self, worker_id: str, engine_url: str | None = None) -> Proc:
        proc = start_worker(self.stack.log_dir, self.stack.env, engine_url or self.stack.engine_url, worker_id)
        self.started.append(proc)
        return proc


@pytest.fixture
def workers(faults: FaultStack) -> Iterator[Workers]:
    started = Workers(faults)
    yield started
    for proc in started.started:
        proc.stop()


def in_background(call: Callable[[], httpx.Response]) -> tuple[ThreadPoolExecutor, Future[httpx.Response]]:
    pool = ThreadPoolExecutor(1)
    return pool, pool.submit(call)


def test_with_no_live_worker_requests_get_503_with_retry_after_fast(faults: FaultStack) -> None:
    assert faults.health().json()["live_workers"] == 0
    for path in ("/v1/systemone", "/v1/jobs"):
        started = time.monotonic()
        response = faults.post(body("Nobody is serving yet."), path)
        assert time.monotonic() - started < 2.0
        assert_error_shape(response, 503, "unavailable_error")
        assert int(response.headers["retry-after"]) >= 1


def test_a_job_interrupted_by_sigkill_is_answered_by_its_restarted_worker_and_runs_once(
        faults: FaultStack, workers: Workers) -> None:
    victim = workers.start("w-restart")
    faults.wait_live("w-restart")
    before = engine_stats(faults.engine_url)
    with DepthWatch(faults.engine_url) as watch:
        pool, call = in_background(lambda: faults.post(body("Killed mid-job, then restarted."),
                                                       timeout=REQUEST_TIMEOUT + 10))
        at_kill = wait_in_flight(faults.engine_url, before)
        victim.kill()
        workers.start("w-restart")  # same id: it waits out the dead one's lease, then re-runs the job
        response = call.result(timeout=REQUEST_TIMEOUT + 15)
        pool.shutdown()
        after = settled(faults.engine_url)
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == {"refund"}
    assert delta(after, at_kill, "requests_aborted") == 1  # the dead worker's call was dropped, not computed
    assert delta(after, at_kill, "requests_finished") == 2  # then one full run: the warm call and the branch
    assert watch.samples > 20 and watch.max_depth == 1  # never two runs of the job live at once


def test_a_job_whose_worker_is_killed_moves_to_the_live_worker_and_runs_there_once(
        faults: FaultStack, workers: Workers) -> None:
    procs = {"w-a": workers.start("w-a"), "w-b": workers.start("w-b")}
    faults.wait_live(*procs)
    before = engine_stats(faults.engine_url)
    with DepthWatch(faults.engine_url) as watch:
        submitted = faults.post(body("Killed mid-job; the other worker takes it."), "/v1/jobs")
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        at_kill = wait_in_flight(faults.engine_url, before)
        owner = faults.job_record(job_id)["worker"]
        procs[owner].kill()
        final = wait_for_job(faults, job_id)
        after = settled(faults.engine_url)
    (survivor,) = set(procs) - {owner}
    assert final["status"] == "succeeded", final
    assert set(final["result"]["answers"]) == {"refund"}
    assert orjson.loads(faults.job_record(job_id)["outcome"])["worker_id"] == survivor
    assert delta(after, at_kill, "requests_aborted") == 1
    assert delta(after, at_kill, "requests_finished") == 2
    assert watch.samples > 20 and watch.max_depth == 1


def wait_for_job(stack: FaultStack, job_id: str) -> dict[str, Any]:
    """GET ?wait= until the job ends; bounded by its deadline and a margin."""
    deadline = time.monotonic() + JOB_TIMEOUT + 15
    while time.monotonic() < deadline:
        view = web.get(f"{stack.url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=20).json()
        if view["status"] not in ("queued", "running"):
            return view
    raise AssertionError(f"job {job_id} still pending past its deadline")


def test_a_job_whose_only_worker_is_killed_gets_504_at_its_deadline(faults: FaultStack, workers: Workers) -> None:
    victim = workers.start("w-lone")
    faults.wait_live("w-lone")
    before = engine_stats(faults.engine_url)
    pool, call = in_background(lambda: faults.post(body("Killed mid-job, never replaced."),
                                                   timeout=REQUEST_TIMEOUT + 10))
    wait_in_flight(faults.engine_url, before)
    victim.kill()
    response = call.result(timeout=REQUEST_TIMEOUT + 15)
    pool.shutdown()
    assert_error_shape(response, 504, "timeout_error")
    assert REQUEST_TIMEOUT - 2 <= response.elapsed.total_seconds() <= REQUEST_TIMEOUT + 3


def test_a_worker_whose_engine_dies_reports_it_stops_taking_jobs_and_exits_3(
        faults: FaultStack, workers: Workers, log_dir: Path) -> None:
    engine = start_scripted_engine(log_dir)
    assert engine.url
    worker = workers.start("w-orphan", engine.url)
    faults.wait_live("w-orphan")
    engine.kill()
    assert wait_for_engine_report(faults, "w-orphan") is False  # its heartbeat says the engine is down
    assert "w-orphan" not in faults.live_worker_ids()  # /health no longer counts it as live
    shown = {w["id"]: w for w in faults.health().json()["workers"]}
    assert shown["w-orphan"]["engine_ok"] is False  # but shows it, with its engine down
    assert worker.alive()  # it reported before giving up
    assert_error_shape(faults.post(body("Only a worker without an engine.")), 503, "unavailable_error")
    assert worker.process.wait(30) == 3
    assert "is down" in worker.output()


def wait_for_engine_report(stack: FaultStack, worker_id: str, timeout: float = 15.0) -> bool | None:
    """The `engine_ok` of the worker's heartbeat once it turns false (None if it never did)."""
    client = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            raw = client.get(keys.worker_key(worker_id))
            if raw and orjson.loads(raw)["engine_ok"] is False:
                return False
            time.sleep(0.05)
    finally:
        client.close()
    return None


def test_while_redis_is_down_the_api_answers_503_fast_and_recovers_when_it_returns(
        faults: FaultStack, workers: Workers) -> None:
    worker = workers.start("w-redis")
    faults.wait_live("w-redis")
    assert faults.post(body("Before the outage."), timeout=REQUEST_TIMEOUT + 10).status_code == 200
    before = engine_stats(faults.engine_url)
    pool, in_flight = in_background(lambda: faults.post(body("In flight when Redis stops."),
                                                        timeout=REQUEST_TIMEOUT + 10))
    wait_in_flight(faults.engine_url, before)
    faults.stop_redis()
    stopped_at = time.monotonic()
    try:
        interrupted = in_flight.result(timeout=REQUEST_TIMEOUT + 15)
        pool.shutdown()
        assert_error_shape(interrupted, 503, "unavailable_error")
        for attempt in range(3):
            started = time.monotonic()
            response = faults.post(body(f"During the outage, attempt {attempt}."))
            assert time.monotonic() - started < 3.0
            assert_error_shape(response, 503, "unavailable_error")
            assert int(response.headers["retry-after"]) >= 1
            started = time.monotonic()
            health = faults.health()
            assert time.monotonic() - started < 3.0
            assert health.status_code == 503
            assert health.json()["status"] == "unavailable" and health.json()["redis"] == "unreachable"
    finally:
        faults.restart_redis()
    deadline = time.monotonic() + 30
    while (response := faults.post(body("After the outage."), timeout=REQUEST_TIMEOUT + 10)).status_code != 200:
        assert response.status_code == 503, response.text  # "not yet", never anything worse
        assert time.monotonic() < deadline, "no success within 30 s of Redis returning"
        time.sleep(0.5)
    outage = time.monotonic() - stopped_at
    assert set(response.json()["answers"]) == {"refund"}
    assert faults.api.alive() and worker.alive()  # nothing was restarted
    # The API's log says why it refused, once at the first refusal and then every 10 s, and that Redis is back.
    wait_until(lambda: "the job queue's Redis works again" in faults.api.output(), 5, "the API's log of the return")
    warned = [e["message"] for e in events(faults.api.output())
              if e.get("level") == "warning" and e["message"].startswith("the job queue's Redis failed")]
    assert 1 <= len(warned) <= 2 + outage // 10, (outage, warned)


# --- under `openjev serve` -------------------------------------------------------------------------


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), read from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        table[int(stat.parent.name)] = (parent, cmdline)
    return table


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its command line."""
    table = process_table()
    found: dict[int, str] = {}
    frontier = {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier} - set(found)
        found |= {child: table[child][1] for child in frontier}
    return found



def child(serve: subprocess.Popen[bytes], subcommand: str) -> tuple[int, str]:
    """The (pid, command line) of serve's `openjev <subcommand>` child."""
    (match,) = [(pid, cmd) for pid, cmd in descendants(serve.pid).items() if f"-m openjev {subcommand}" in cmd]
    return match


def port_of(cmdline: str) -> int:
    words = cmdline.split()
    return int(words[words.index("--port") + 1])


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_serve(log_dir: Path, *args: str, **env: str) -> Served:
    port = free_port()
    log = log_dir / f"serve-{time.monotonic_ns()}.log"
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "openjev", "serve", "--port", str(port), *args],
                                   env={**os.environ, "OPENJEV_CACHE_DIR": str(model_cache_dir().parent),
                                        "OPENJEV_REDIS_DIR": str(log.with_suffix(".redis")), **env},
                                   stdout=handle, stderr=subprocess.STDOUT)
    served = Served(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited with {process.returncode}:\n{served.output()[-4000:]}"
        try:
            # serve's own API, not another test's server that took the port before serve's API bound it
            if web.get(served.url + "/health", timeout=2).status_code == 200 and listens_on(process.pid, port):
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_serve(served)
    raise AssertionError(f"serve not ready within {START_TIMEOUT:g} s:\n{served.output()[-4000:]}")


def stop_serve(served: Served) -> None:
    if served.process.poll() is None:
        served.process.terminate()
        try:
            served.process.wait(30)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()


@pytest.fixture(scope="module")
def served(log_dir: Path) -> Iterator[Served]:
    """`openjev serve` with the CPU engine stalling each prompt, so a request is surely in flight."""
    served = start_serve(log_dir, "--compute-delay", "1.0", OPENJEV_REQUEST_TIMEOUT="40")
    yield served
    stop_serve(served)


def test_under_serve_a_worker_killed_mid_request_is_restarted_and_the_request_answered(served: Served) -> None:
    worker_pid, _ = child(served.process, "worker")
    engine_url = f"http://127.0.0.1:{port_of(child(served.process, 'engine')[1])}"
    before = engine_stats(engine_url)
    pool, call = in_background(lambda: web.post(served.url + "/v1/systemone", json=body("Serve loses a worker."),
                                                timeout=60))
    wait_in_flight(engine_url, before)
    os.kill(worker_pid, signal.SIGKILL)
    response = call.result(timeout=75)
    pool.shutdown()
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == {"refund"}
    assert child(served.process, "worker")[0] != worker_pid  # the supervisor started a new one
    assert "restarting it" in served.output()


def test_under_serve_an_engine_that_dies_stops_serve_nonzero_leaving_no_children(served: Served) -> None:
    children = descendants(served.process.pid)
    engine_pid, _ = child(served.process, "engine")
    os.kill(engine_pid, signal.SIGKILL)
    assert served.process.wait(60) != 0
    assert [cmd for pid, cmd in children.items() if alive(pid)] == []


def test_under_serve_connect_a_worker_whose_engine_dies_stops_serve_nonzero(model_dir: Path, log_dir: Path) -> None:
    engine = start_scripted_engine(log_dir)
    assert engine.url
    served = start_serve(log_dir, "--connect", engine.url, OPENJEV_TOKENIZER=str(model_dir),
                         OPENJEV_SERVED_MODEL_NAME="HuggingFaceTB/SmolLM2-135M-Instruct")
    try:
        children = descendants(served.process.pid)
        engine.kill()  # not serve's child: only the worker can notice
        assert served.process.wait(120) != 0
        assert "worker-0 exited with 3" in served.output()
        assert [cmd for pid, cmd in children.items() if alive(pid)] == []
    finally:
        stop_serve(served)


def test_under_serve_jobs_whose_engine_died_run_once_serve_is_restarted_on_the_same_redis(
        log_dir: Path, tmp_path: Path) -> None:
    """The engine is SIGKILLed with async jobs accepted, one of them in flight: serve stops (its platform
    restarts it); a new serve on the same Redis directory runs every job, none failed."""
    redis_dir = str(tmp_path / "redis")
    first = start_serve(log_dir, "--compute-delay", "1.0", OPENJEV_REDIS_DIR=redis_dir)
    try:
        engine_pid, engine_cmd = child(first.process, "engine")
        engine_url = f"http://127.0.0.1:{port_of(engine_cmd)}"
        before = engine_stats(engine_url)
        jobs = []
        for i in range(4):
            submitted = web.post(first.url + "/v1/jobs", json=body(f"Engine crash, ticket {i}."), timeout=30)
            assert submitted.status_code == 202, submitted.text
            jobs.append(submitted.json()["id"])
        wait_in_flight(engine_url, before)
        os.kill(engine_pid, signal.SIGKILL)
        assert first.process.wait(60) != 0
    finally:
        stop_serve(first)
    second = start_serve(log_dir, "--compute-delay", "1.0", OPENJEV_REDIS_DIR=redis_dir)
    try:
        views = []
        for job_id in jobs:
            deadline = time.monotonic() + 300
            while (view := web.get(f"{second.url}/v1/jobs/{job_id}", params={"wait": 10},
                                   timeout=20).json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, f"job {job_id} still pending"
            views.append(view)
    finally:
        stop_serve(second)
    assert [v["status"] for v in views] == ["succeeded"] * len(jobs), views
    assert all(set(v["result"]["answers"]) == {"refund"} for v in views)
    assert max(v.get("attempts", 1) for v in views) >= 2  # the job in flight at the crash ran again
