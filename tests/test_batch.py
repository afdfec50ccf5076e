"""`openjev batch` end to end: against a real stack (scripted engine, and once the CPU engine) for
order, per-line errors and resume; against a stub on loopback for Retry-After and bounded retries."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.processes import ROOT
from harness.stacks import Stack
from harness.web import web
from openjev.batch import BatchOptions, retry_after, run_batch

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"Billing": "Payments", "Technical": None}},
}
STATES = ["I was charged twice.", "The app crashes on login.", "Please refund my order.", "Where is my invoice?",
          "Thanks, all good now."]


class Raw(str):
    """An input line written verbatim rather than as JSON (to make invalid lines)."""


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, Raw) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines))
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch(tmp_path: Path, url: str, lines: list[Any], **options: Any) -> tuple[int, list[dict[str, Any]]]:
    questions = write_lines(tmp_path / "questions.json", [QUESTIONS])
    output = tmp_path / "out.jsonl"
    input_path = write_lines(tmp_path / "in.jsonl", lines)
    code = run_batch(BatchOptions(input=input_path, output=output, url=url, questions=questions, progress=False,
                                  **options))
    return code, read_records(output)


def engine_requests(stack: Stack) -> int:
    return stack.engine_stats()["requests_received"]


class Counts(dict):
    def __sub__(self, other: dict[str, int]) -> dict[str, int]:
        return {status: self.get(status, 0) - other.get(status, 0) for status in ("200", "202")}


def job_submits(stack: Stack) -> Counts:
    """POST /v1/jobs answers so far by status, from the API's /metrics: 202 a new job, 200 one a key found."""
    counts = Counts()
    for family in text_string_to_metric_families(web.get(stack.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "openjev_requests_total" and sample.labels["route"] == "/v1/jobs":
                counts[sample.labels["status"]] = int(sample.value)
    return counts


def test_output_has_one_line_per_input_line_in_order_with_errors_recorded(scripted_stack: Stack,
                                                                            tmp_path: Path) -> None:
    lines = [
        {"id": "full", "model": "jev-latest", "state": "Refund me.", "questions": {"only": {"type": "noul"}}},
        {"id": 7, "state": {"messages": [{"role": "user", "content": "The app crashes."}]}},
        Raw("not json {"),
        "Bare string state.",
        {"state": "x", "questions": {"q": {"type": "bogus"}}},
        {"state": "Where is my invoice?"},
    ]
    code, records = batch(tmp_path, scripted_stack.url, lines, concurrency=3)

    assert code == 1
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r.get("id") for r in records] == ["full", 7, None, None, None, None]
    assert list(records[0]["result"]["answers"]) == ["only"]
    for record in (records[1], records[3], records[5]):
        assert list(record["result"]["answers"]) == list(QUESTIONS)
    assert records[2]["error"]["error_type"] == "invalid_json"
    assert records[2]["error"]["status"] is None
    assert records[4]["error"]["status"] == 422
    assert "questions" in records[4]["error"]["message"]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_resume_after_a_crash_submits_only_lines_without_a_record(scripted_stack: Stack, tmp_path: Path) -> None:
    before = engine_requests(scripted_stack)
    code, first = batch(tmp_path, scripted_stack.url, STATES)
    per_line, remainder = divmod(engine_requests(scripted_stack) - before, len(STATES))
    assert code == 0 and per_line > 0 and remainder == 0

    # What a run killed mid-way leaves: lines 1, 2 and 4 done, line 5 torn mid-write, no ordered output yet.
    output = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    torn = json.dumps(first[4])[:40]
    partial.write_text("".join(json.dumps(first[i]) + "\n" for i in (0, 1, 3)) + torn)
    output.unlink()

    before, submits = engine_requests(scripted_stack), job_submits(scripted_stack)
    code, resumed = batch(tmp_path, scripted_stack.url, STATES)
    assert code == 0
    # Lines 3 and 5 only are submitted again, and their Idempotency-Keys find the jobs the first run made
    # (200, not a new 202): no engine work is done again.
    assert job_submits(scripted_stack) - submits == {"200": 2, "202": 0}
    assert engine_requests(scripted_stack) - before == 0
    assert resumed == first
    assert not partial.exists()


def test_rerun_of_a_finished_batch_submits_nothing(scripted_stack: Stack, tmp_path: Path) -> None:
    batch(tmp_path, scripted_stack.url, STATES[:3])
    before = engine_requests(scripted_stack)
    code, records = batch(tmp_path, scripted_stack.url, STATES[:3])
    assert code == 0
    assert engine_requests(scripted_stack) - before == 0
    assert [r["line"] for r in records] == [1, 2, 3]


def test_retry_errors_redoes_only_the_lines_recorded_with_an_error(scripted_stack: Stack, tmp_path: Path) -> None:
    code, first = batch(tmp_path, scripted_stack.url, [*STATES[:2], Raw("not json {")])
    assert code == 1

    before = engine_requests(scripted_stack)
    code, records = batch(tmp_path, scripted_stack.url, STATES[:3], retry_errors=True)  # line 3 fixed
    assert code == 0
    assert records[:2] == first[:2]
    assert "result" in records[2]
    assert engine_requests(scripted_stack) - before > 0


@pytest.mark.integration
def test_batch_classifies_with_the_cpu_engine(cpu_stack: Stack, tmp_path: Path) -> None:
    code, records = batch(tmp_path, cpu_stack.url, [STATES[0], {"id": "b", "state": STATES[1]}, Raw("{broken")])
    assert code == 1
    assert [r["line"] for r in records] == [1, 2, 3]
    for record in records[:2]:
        team = record["result"]["answers"]["team"]
        assert sum(team["probabilities"].values()) == pytest.approx(1.0)
        assert 0.0 <= record["result"]["answers"]["refund"]["noul"] <= 1.0
    assert records[1]["id"] == "b"
    assert records[2]["error"]["error_type"] == "invalid_json"


class StubJobs(BaseHTTPRequestHandler):
    """The jobs API in miniature: the first `shed` submits get 529 with `retry_after`, then jobs succeed."""

    url: ClassVar[str] = ""
    shed: ClassVar[int] = 0
    retry_after: ClassVar[str] = "1"
    submits: ClassVar[list[tuple[float, str | None]]] = []  # (when, Idempotency-Key) of each submit

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).submits.append((time.monotonic(), self.headers.get("Idempotency-Key")))
        if len(self.submits) <= self.shed:
            self._reply(529, {"detail": {"error_type": "overloaded_error", "message": "busy"}},
                        {"Retry-After": self.retry_after})
        else:
            self._reply(202, {"id": "job1", "status": "queued", "created_at": "2026-01-01T00:00:00Z",
                              "deadline_at": "2999-01-01T00:00:00Z"})

    def do_GET(self) -> None:
        self._reply(200, {"id": "job1", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z",
                          "deadline_at": "2999-01-01T00:00:00Z", "result": {"answers": {}}})

    def _reply(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[type[StubJobs]]:
    handler = type("Stub", (StubJobs,), {"submits": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


def test_a_529_is_retried_after_its_retry_after_with_the_same_idempotency_key(stub: type[StubJobs],
                                                                               tmp_path: Path) -> None:
    stub.shed, stub.retry_after = 1, "1"
    code, records = batch(tmp_path, stub.url, ["one state"])
    assert code == 0
    assert records == [{"line": 1, "result": {"answers": {}}}]
    (first, key1), (second, key2) = stub.submits
    assert second - first >= 1.0
    assert key1 == key2 is not None


def test_retries_are_bounded_and_the_last_answer_is_recorded(stub: type[StubJobs], tmp_path: Path) -> None:
    stub.shed, stub.retry_after = 100, "0"
    code, records = batch(tmp_path, stub.url, ["one state"], max_attempts=3)
    assert code == 1
    assert records[0]["error"] == {"status": 529, "error_type": "overloaded_error", "message": "busy"}
    assert len(stub.submits) == 3


def test_retry_after_reads_seconds_and_http_dates_within_bounds() -> None:
    def answer(value: str) -> httpx.Response:
        return httpx.Response(529, headers={"Retry-After": value})

    assert retry_after(answer("2"), attempt=1) == 2.0
    assert 3.0 <= retry_after(answer(formatdate(time.time() + 5, usegmt=True)), attempt=1) <= 5.0
    assert retry_after(answer("86400"), attempt=1) == 60.0
    assert retry_after(answer("soon"), attempt=3) == 2.0


class KeyedJobs(BaseHTTPRequestHandler):
    """The jobs API's Idempotency-Key in miniature: a key already used answers 200 with its job. Jobs stay
    `running` until `done` is set; then they end with `outcome` (as the job was when it was made)."""

    url: ClassVar[str] = ""
    jobs: ClassVar[dict[str, dict[str, Any]]] = {}  # job id -> view
    keys: ClassVar[dict[str, str]] = {}  # Idempotency-Key -> job id
    outcome: ClassVar[str] = "succeeded"
    done: ClassVar[threading.Event]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        key = self.headers["Idempotency-Key"]
        if key in self.keys:
            self._reply(200, self._view(self.keys[key]))
            return
        job_id = f"job{len(self.jobs)}"
        self.jobs[job_id] = {"id": job_id, "status": "running", "outcome": self.outcome,
                             "created_at": "2026-01-01T00:00:00Z", "deadline_at": "2999-01-01T00:00:00Z"}
        self.keys[key] = job_id
        self._reply(202, self._view(job_id))

    def do_GET(self) -> None:
        job_id = self.path.split("?")[0].rsplit("/", 1)[1]
        if not self.done.is_set():
            self.done.wait(0.5)  # a short long-poll
        self._reply(200, self._view(job_id))

    def _view(self, job_id: str) -> dict[str, Any]:
        job = dict(self.jobs[job_id])
        if self.done.is_set():
            job["status"] = job["outcome"]
            if job["status"] == "succeeded":
                job["result"] = {"answers": {}, "job": job_id}
            else:
                job["error"] = {"error_type": "engine_error", "message": f"{job_id} failed"}
        del job["outcome"]
        return job

    _reply = StubJobs._reply
    log_message = StubJobs.log_message


@pytest.fixture
def keyed() -> Iterator[type[KeyedJobs]]:
    handler = type("Keyed", (KeyedJobs,), {"jobs": {}, "keys": {}, "done": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    handler.done.set()
    server.shutdown()
    server.server_close()


def test_jobs_in_flight_at_ctrl_c_are_reused_on_resume_not_submitted_again(keyed: type[KeyedJobs],
                                                                          tmp_path: Path) -> None:
    questions = write_lines(tmp_path / "questions.json", [QUESTIONS])
    input_path = write_lines(tmp_path / "in.jsonl", STATES[:3])
    output = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "openjev", "batch", str(input_path), "--url", keyed.url, "-o", str(output),
            "--questions", str(questions)]
    # A terminal's foreground job has SIGINT at its default; a runner that starts the tests in the background
    # (CI does) has it ignored, and an ignored signal stays ignored across exec. A Python-level handler does
    # not: the child starts with the default, as under a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 60
        while len(keyed.jobs) < 3:  # every line's job is in flight
            assert time.monotonic() < deadline and run.poll() is None, "the batch never submitted its lines"
            time.sleep(0.05)
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=30) == 130
    finally:
        if run.poll() is None:
            run.kill()
    assert "rerun the same command to resume" in run.stderr.read().decode()

    keyed.done.set()
    code = run_batch(BatchOptions(input=input_path, output=output, url=keyed.url, questions=questions,
                                  progress=False))
    assert code == 0
    assert len(keyed.jobs) == 3  # the rerun made no new job
    assert sorted(r["result"]["job"] for r in read_records(output)) == ["job0", "job1", "job2"]


def test_retry_errors_submits_a_failed_line_as_a_new_job(keyed: type[KeyedJobs], tmp_path: Path) -> None:
    keyed.outcome = "failed"
    keyed.done.set()
    code, first = batch(tmp_path, keyed.url, STATES[:2])
    assert code == 1 and sorted(r["error"]["message"] for r in first) == ["job0 failed", "job1 failed"]

    code, again = batch(tmp_path, keyed.url, STATES[:2])  # without --retry-errors: kept as they are
    assert code == 1 and again == first and len(keyed.jobs) == 2

    keyed.outcome = "succeeded"
    code, retried = batch(tmp_path, keyed.url, STATES[:2], retry_errors=True)
    assert code == 0 and sorted(r["result"]["job"] for r in retried) == ["job2", "job3"]
