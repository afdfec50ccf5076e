"""The engine health probe, apart from worker liveness: a busy engine (a slow `/health`, as SGLang's
under load) stays routed and the worker keeps heartbeating; a dead or hung engine is taken out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from common import keys
from tests.conftest import Stack, isolated_scripted_stack
from tests.processes import start_scripted_engine
from worker.engine_health import EngineHealth, HealthPolicy, Probe

FAST = HealthPolicy(interval=0.1, timeout=0.5)


def folded(*results: Probe, policy: HealthPolicy = FAST) -> EngineHealth:
    health = EngineHealth("http://127.0.0.1:1", policy)
    for result in results:
        health.record(result)
    return health


def test_one_silent_probe_is_a_busy_engine_that_stays_routed() -> None:
    health = folded(Probe.healthy, Probe.silent)
    assert health.routable and not health.down.is_set()


def test_silent_probes_in_a_row_take_the_engine_out_then_give_it_up() -> None:
    health = folded(Probe.silent, Probe.silent)
    assert not health.routable and not health.down.is_set()
    health.record(Probe.silent)
    assert health.down.is_set()


@pytest.mark.parametrize("result", [Probe.refused, Probe.unhealthy])
def test_a_refusal_or_an_unhealthy_answer_takes_the_engine_out_at_once(result: Probe) -> None:
    health = folded(Probe.healthy, result)
    assert not health.routable and not health.down.is_set()


def test_a_healthy_answer_puts_the_engine_back_and_restarts_the_count() -> None:
    health = folded(Probe.refused, Probe.silent, Probe.healthy, Probe.refused, Probe.refused)
    assert not health.routable and not health.down.is_set()
    health.record(Probe.healthy)
    assert health.routable


async def test_probe_reads_healthy_unhealthy_silent_and_refused_from_a_real_server(log_dir: Path) -> None:
    engine = start_scripted_engine(log_dir)
    assert engine.url
    health = EngineHealth(engine.url, FAST)
    try:
        assert await health.probe() is Probe.healthy
        script(engine.url, healthy=False)
        assert await health.probe() is Probe.unhealthy
        script(engine.url, healthy=True, health_delay=5.0)
        started = time.monotonic()
        assert await health.probe() is Probe.silent
        assert time.monotonic() - started < 2.0  # the probe gives up at its own timeout
        engine.kill()
        assert await health.probe() is Probe.refused
    finally:
        await health.close()
        engine.stop()


def script(engine_url: str, **settings: object) -> None:
    httpx.post(f"{engine_url}/script", json=settings, timeout=5).raise_for_status()


@dataclass
class Membership:
    """What the routing set says about one worker, sampled from Redis."""

    heartbeat_age: float  # seconds since its last heartbeat
    engine_ok: bool | None  # as its last heartbeat said (None: no description in Redis)


def sample(client: redis.Redis, worker_id: str) -> Membership:
    now = time.time()
    score = client.zscore(keys.WORKERS, worker_id)
    raw = client.get(keys.worker_key(worker_id))
    return Membership(now - score if score is not None else float("inf"),
                      orjson.loads(raw)["engine_ok"] if raw else None)


def watch(stack: Stack, seconds: float) -> list[Membership]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        samples = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            samples.append(sample(client, "w0"))
            time.sleep(0.1)
        return samples
    finally:
        client.close()


@pytest.fixture
def slow_health_stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir) as stack:
        yield stack


@pytest.mark.integration
def test_a_busy_engine_whose_health_takes_7_s_stays_live_and_answers(slow_health_stack: Stack) -> None:
    stack = slow_health_stack
    assert stack.post(_one_question("Before the engine gets busy.")).status_code == 200
    # SGLang's /health under load took 3-7.5 s (a one-token generation queued behind real work).
    stack.script(health_delay=7.0)
    samples = watch(stack, 16.0)
    assert max(s.heartbeat_age for s in samples) < 3.0  # never near the 5 s liveness window
    assert all(s.engine_ok for s in samples), "a slow health answer took the worker out of routing"
    response = stack.post(_one_question("While the health route is slow."))
    assert response.status_code == 200, response.text
    assert stack.workers[0].alive()


@pytest.mark.integration
def test_a_hung_engine_is_taken_out_of_routing_and_the_worker_exits_3(model_dir: Path, log_dir: Path) -> None:
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_ENGINE_HEALTH_TIMEOUT="1",
                                 OPENJEV_ENGINE_HEALTH_INTERVAL="0.2") as stack:
        stack.script(health_delay=3600.0)
        client = redis.Redis.from_url(stack.redis_url)
        try:
            deadline = time.monotonic() + 30
            while sample(client, "w0").engine_ok is not False:
                assert time.monotonic() < deadline, "a hung engine stayed routed"
                time.sleep(0.1)
        finally:
            client.close()
        assert stack.post(_one_question("Nobody can answer.")).status_code == 503
        assert stack.workers[0].process.wait(30) == 3
        assert "is down" in stack.workers[0].output()


def _one_question(state: str) -> dict[str, object]:
    return {"model": "jev-latest", "state": state,
            "questions": {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}}
