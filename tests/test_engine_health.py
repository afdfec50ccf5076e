"""The engine health probe, apart from worker liveness: a busy engine (a slow `/health`, as SGLang's
under load) stays routed and the worker keeps heartbeating; a dead or hung engine is taken out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import redis

from common.queue import keys
from harness.processes import start_scripted_engine
from harness.stacks import Stack, isolated_scripted_stack
from harness.web import web
from tests.test_logs import events
from worker.engine_health import EngineHealth, HealthPolicy, Probe

FAST = HealthPolicy(interval=0.1, timeout=0.5)
TIMEOUT = HealthPolicy().timeout  # 30 s: unresponsive 60 s takes an engine out, 180 s gives it up


class Engine:
    """Probe results fed to an `EngineHealth` on a clock of the test's own, with the engine's calls."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.answered_at = 0.0
        self.in_flight = False
        self.health = EngineHealth("http://127.0.0.1:1", HealthPolicy(), last_seen_working=self.seen_working)

    def seen_working(self) -> float:
        return self.now if self.in_flight else self.answered_at

    def probe(self, result: Probe, takes: float = 20.0) -> Engine:
        started, self.now = self.now, self.now + takes
        self.health.record(result, started, self.now)
        self.now += HealthPolicy().interval
        return self

    def answers_a_call(self) -> Engine:
        self.answered_at = self.now
        return self

    def has_calls_in_flight(self, in_flight: bool = True) -> Engine:
        self.in_flight = in_flight
        return self


def test_a_silent_or_unhealthy_probe_of_a_busy_engine_keeps_it_routed() -> None:
    engine = Engine().probe(Probe.healthy).probe(Probe.silent, TIMEOUT).probe(Probe.unhealthy)
    assert engine.health.routable and not engine.health.down.is_set()


def test_failed_probes_do_not_outweigh_calls_the_engine_keeps_answering() -> None:
    # SGLang on a loaded CPU: /health answers 503 for minutes while the jobs' calls complete.
    engine = Engine()
    for _ in range(20):
        engine.probe(Probe.unhealthy).answers_a_call()
        assert engine.health.routable
    assert not engine.health.down.is_set()


def test_one_call_in_flight_for_minutes_keeps_an_engine_with_failing_probes_routed() -> None:
    # A 255-option prefill on SGLang on a loaded CPU: one forward pass of minutes, /health 503 throughout.
    engine = Engine().probe(Probe.healthy).has_calls_in_flight()
    for _ in range(20):
        engine.probe(Probe.unhealthy)
        assert engine.health.routable
    engine.probe(Probe.silent, TIMEOUT)
    assert engine.health.routable and not engine.health.down.is_set()
    engine.has_calls_in_flight(False)  # its job's deadline ended the call: an idle engine now
    for _ in range(4):
        engine.probe(Probe.silent, TIMEOUT)
    assert not engine.health.routable
    engine.probe(Probe.silent, TIMEOUT).probe(Probe.silent, TIMEOUT)
    assert engine.health.down.is_set()


def test_an_engine_unresponsive_with_no_call_answered_is_taken_out_then_given_up() -> None:
    engine = Engine().probe(Probe.silent, TIMEOUT)
    assert engine.health.routable  # one silent probe: busy
    engine.probe(Probe.silent, TIMEOUT)
    assert not engine.health.routable and not engine.health.down.is_set()  # 2 timeouts unresponsive: out
    for _ in range(3):
        engine.probe(Probe.silent, TIMEOUT)
    assert not engine.health.down.is_set()
    engine.probe(Probe.silent, TIMEOUT)
    assert engine.health.down.is_set()  # 6 timeouts unresponsive: hung


def test_a_refused_connection_takes_the_engine_out_at_once_and_three_give_it_up() -> None:
    engine = Engine().probe(Probe.healthy).probe(Probe.refused, 0.001)
    assert not engine.health.routable and not engine.health.down.is_set()
    engine.probe(Probe.unhealthy, 0.5)  # restarting: it answers, but is not back yet
    assert not engine.health.routable
    engine.probe(Probe.refused, 0.001).probe(Probe.refused, 0.001)
    assert not engine.health.down.is_set()  # the refusals were not consecutive
    engine.probe(Probe.refused, 0.001)
    assert engine.health.down.is_set()


def test_a_healthy_answer_puts_the_engine_back_and_restarts_the_count() -> None:
    engine = Engine().probe(Probe.refused, 0.001).probe(Probe.silent, TIMEOUT).probe(Probe.healthy, 0.01)
    assert engine.health.routable
    engine.probe(Probe.silent, TIMEOUT)
    assert engine.health.routable


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
    web.post(f"{engine_url}/script", json=settings, timeout=5).raise_for_status()


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
def test_an_engine_answering_calls_while_its_health_says_503_stays_routed(model_dir: Path, log_dir: Path) -> None:
    # SGLang on a loaded CPU answers /health 503 when one forward pass outlasts its 20 s health
    # check, while the jobs' calls keep completing. Probe timeout 1 s: 2 s unresponsive with no
    # call answered takes the engine out, 6 s gives it up.
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_ENGINE_HEALTH_TIMEOUT="1",
                                 OPENJEV_ENGINE_HEALTH_INTERVAL="0.2") as stack:
        stack.script(healthy=False)
        started = time.monotonic()
        client = redis.Redis.from_url(stack.redis_url)
        try:
            samples, end, i = [], time.monotonic() + 10, 0
            while time.monotonic() < end:
                response = stack.post(_one_question(f"Busy engine, request {i}."))
                assert response.status_code == 200, response.text
                samples.append(sample(client, "w0"))
                i += 1
            assert i > 10 and all(s.engine_ok for s in samples)
            # With no calls any more, the 503s are all there is: the engine counts as hung.
            assert stack.workers[0].process.wait(30) == 3
            took = time.monotonic() - started
        finally:
            client.close()
        # A probe failed every 0.2 s throughout: the log has a warning every 10 s with the count, not one a probe,
        # and the engine's leaving routing once calls stopped.
        messages = [e["message"] for e in events(stack.workers[0].output()) if e.get("level") == "warning"]
        warned = [m for m in messages if m.startswith("engine health probe")]
        assert 1 <= len(warned) <= 2 + took // 10, (took, len(warned), warned[:3])
        assert warned[0] == "engine health probe failed ('unhealthy'); routed: True", warned
        assert "engine taken out of routing after a probe unhealthy" in messages, messages


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


def test_a_failed_call_takes_the_engine_out_until_a_probe_gets_an_answer() -> None:
    engine = Engine().probe(Probe.healthy)
    engine.health.suspect()  # a call failed for the engine's sake (a 5xx, a reset)
    assert not engine.health.routable and not engine.health.answering.is_set()
    engine.probe(Probe.silent, 1.0)
    assert not engine.health.routable and not engine.health.answering.is_set()
    engine.probe(Probe.unhealthy, 1.0)  # SGLang's 503 when busy: it is there and answering
    assert engine.health.routable and engine.health.answering.is_set()
    engine.health.suspect()
    engine.probe(Probe.refused, 0.001)
    assert not engine.health.routable and not engine.health.answering.is_set()
    engine.probe(Probe.healthy, 0.01)
    assert engine.health.routable and engine.health.answering.is_set()
