"""Structured logs: one JSON event per request and per job, carrying the ids; no bodies, no keys."""

from __future__ import annotations

import json
import logging

import pytest

from common.logs import JsonFormatter, RepeatedFailure
from harness.processes import Proc
from harness.stacks import Stack
from tests.conftest import wait_until
from tests.test_api_contract import NOUL


def events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def test_a_log_record_becomes_one_json_line_with_its_event_fields() -> None:
    record = logging.LogRecord("openjev.api", logging.INFO, __file__, 1, "request", None, None)
    record.event, record.request_id, record.status = "request", "req_abc", 200
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["event"] == "request" and data["request_id"] == "req_abc" and data["status"] == 200
    assert data["level"] == "info" and data["ts"].endswith("Z")


def test_a_failure_repeated_every_second_warns_once_then_every_ten_seconds_and_says_when_it_recovers(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    failures = RepeatedFailure(logging.getLogger("openjev.test"), "heartbeat", interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="openjev.test"):
        for _ in range(25):  # 25 s of an outage, a try a second
            failures.failed(ConnectionError("refused"), "the next beat tries again")
            now[0] += 1.0
        failures.succeeded()
        failures.succeeded()  # nothing more to say
        now[0] += 10.0
        failures.failed(ConnectionError("again"))  # a new outage warns at once
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("WARNING", "heartbeat failed (ConnectionError('refused')); the next beat tries again"),
        ("WARNING", "heartbeat failed (ConnectionError('refused'); 10 more failures in 10 s, 11 in 10 s); "
                    "the next beat tries again"),
        ("WARNING", "heartbeat failed (ConnectionError('refused'); 10 more failures in 10 s, 21 in 20 s); "
                    "the next beat tries again"),
        ("INFO", "heartbeat works again after 25 failures in 25.0 s"),
        ("WARNING", "heartbeat failed (ConnectionError('again'))"),
    ]


def test_a_failure_that_flaps_with_successes_warns_at_the_same_pace(caplog: pytest.LogCaptureFixture) -> None:
    """A Redis near its maxmemory refuses a write, takes the next: the successes between do not start the
    warnings over. 30 s of a failure and a success each second: one warning and its recovery line per 10 s,
    where a warning and a recovery line each second would come without the pace kept across successes."""
    now = [100.0]
    failures = RepeatedFailure(logging.getLogger("openjev.test"), "store", interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="openjev.test"):
        for _ in range(30):
            failures.failed(ConnectionError("OOM"))
            now[0] += 0.5
            failures.succeeded()
            now[0] += 0.5
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("WARNING", "store failed (ConnectionError('OOM'))"),
        ("INFO", "store works again after 1 failures in 0.5 s"),
        ("WARNING", "store failed (ConnectionError('OOM'); 10 more failures in 10 s, working again 9 times between)"),
        ("INFO", "store works again after 1 failures in 0.5 s"),
        ("WARNING", "store failed (ConnectionError('OOM'); 10 more failures in 10 s, working again 9 times between)"),
        ("INFO", "store works again after 1 failures in 0.5 s"),
    ]


def test_each_request_and_job_logs_one_event_with_ids_and_no_body_or_key(scripted_stack: Stack) -> None:
    secret_state = "state-text-that-must-never-be-logged-7f3a"
    r = scripted_stack.post({"model": "jev-latest", "state": secret_state, "questions": {"q": NOUL}},
                            headers={"Authorization": "Bearer key-that-must-never-be-logged"})
    assert r.status_code == 200
    request_id = r.headers["x-typesafe-request-id"]

    def logged(proc: Proc, event: str) -> bool:
        return any(e.get("event") == event and e.get("request_id") == request_id for e in events(proc.output()))

    # each process logs its event once its answer has gone out, so after the response: wait for both
    wait_until(lambda: logged(scripted_stack.api, "request") and logged(scripted_stack.workers[0], "job"), 10,
               "the request's event in the API log and its job's in the worker log")
    api_log = scripted_stack.api.output()
    worker_log = scripted_stack.workers[0].output()
    request_events = [e for e in events(api_log) if e.get("request_id") == request_id and e.get("event") == "request"]
    assert len(request_events) == 1
    event = request_events[0]
    assert event["status"] == 200 and event["path"] == "/v1/systemone" and event["job_id"].startswith("job_")
    job_events = [e for e in events(worker_log) if e.get("job_id") == event["job_id"] and e.get("event") == "job"]
    assert len(job_events) == 1 and job_events[0]["status"] == "succeeded"
    assert job_events[0]["request_id"] == request_id
    for text in (api_log, worker_log):
        assert secret_state not in text
        assert "key-that-must-never-be-logged" not in text
