"""`openjev smoke`: against the real CPU stack, against the scripted engine without cache reports, and
against small in-process stubs that answer 503 forever or answer the contract with a useless model."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from harness.stacks import Stack
from openjev.smoke import TARGET_OPTION, many_options, response_problems, run_smoke

CONTRACT_CHECKS = {"limits", "models", "noul", "choice", "score", "choice_64_options", "choice_255_options",
                   "too_many_options_rejected", "multi_question", "async_job"}
TARGETED_CHECKS = {"choice_64_options", "choice_255_options"}  # contract checks with an obvious target
SEMANTIC_CHECKS = {"refund_is_a_money_back_request", "billing_complaint_routes_to_billing"}
EVALUATIONS = {"noul", "choice", "score", "choice_64_options", "choice_255_options", "multi_question",
               "refund_is_a_money_back_request", "billing_complaint_routes_to_billing"}
CHECK_FIELDS = {"name", "passed", "outcome", "semantic", "status", "latency_s", "attempts", "prefix_tokens",
                "cached_tokens", "request_id", "detail"}


def smoke(url: str, out: Path, **options: Any) -> tuple[int, dict[str, Any]]:
    code = run_smoke(url, out=out, **options)
    return code, json.loads(out.read_text())


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


def failures(report: dict[str, Any]) -> list[str]:
    return [f"{c['name']}: {c['detail']}" for c in report["checks"] if c["outcome"] == "fail"]


@pytest.fixture(scope="module")
def cpu_smoke(cpu_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    """One smoke run against the real CPU stack, shared by the tests that read its result."""
    return smoke(cpu_stack.url, tmp_path_factory.mktemp("smoke") / "smoke-result.json",
                 allow_weak_model=True, startup_timeout=120)


@pytest.mark.integration
def test_smoke_passes_against_the_cpu_stack_with_a_weak_model(cpu_smoke: tuple[int, dict[str, Any]]) -> None:
    code, report = cpu_smoke
    assert code == 0, failures(report)
    assert report["passed"] and report["exit_code"] == 0 and report["ready"]
    outcomes = {c["name"]: c["outcome"] for c in report["checks"]}
    assert {outcomes[name] for name in CONTRACT_CHECKS - TARGETED_CHECKS} == {"pass"}, outcomes
    # SmolLM2-135M may miss the obvious option among 255; the contract part of those checks held.
    for name in TARGETED_CHECKS | SEMANTIC_CHECKS:
        check = by_name(report)[name]
        assert check["outcome"] == "pass" or check["detail"].startswith("semantic:"), check


@pytest.mark.integration
def test_smoke_result_records_startup_latency_and_tokens_per_check(cpu_smoke: tuple[int, dict[str, Any]]) -> None:
    _, report = cpu_smoke
    assert {"url", "started_at", "finished_at", "duration_s", "allow_weak_model", "ready", "startup_wait_s",
            "startup", "model", "max_options", "passed", "exit_code", "summary", "checks"} <= set(report)
    assert isinstance(report["startup_wait_s"], float) and report["startup_wait_s"] >= 0
    assert report["max_options"] == 255
    checks = by_name(report)
    assert set(checks) == CONTRACT_CHECKS | SEMANTIC_CHECKS
    for check in checks.values():
        assert set(check) == CHECK_FIELDS
        assert check["latency_s"] > 0 and check["status"] is not None
    for name in EVALUATIONS:
        # The CPU engine reports cache hits, so both headers are there and are real counts.
        assert checks[name]["prefix_tokens"] > 0, checks[name]
        assert isinstance(checks[name]["cached_tokens"], int), checks[name]
        assert checks[name]["request_id"].startswith("req_")
    assert checks["too_many_options_rejected"]["status"] == 422
    assert checks["async_job"]["status"] == 200


@pytest.mark.integration
def test_cached_tokens_are_null_not_zero_when_the_engine_does_not_report_them(scripted_stack: Stack,
                                                                              tmp_path: Path) -> None:
    scripted_stack.script(report_cached=False)
    try:
        _, report = smoke(scripted_stack.url, tmp_path / "r.json", allow_weak_model=True, startup_timeout=60)
    finally:
        scripted_stack.script(report_cached=True)
    checks = by_name(report)
    for name in EVALUATIONS:
        assert checks[name]["status"] == 200, checks[name]
        assert checks[name]["cached_tokens"] is None, checks[name]
        assert checks[name]["prefix_tokens"] > 0, checks[name]


def test_smoke_gives_up_on_a_server_that_answers_503_forever(tmp_path: Path) -> None:
    with stub_server(lambda handler: handler.reply(503, {"status": "starting"}, {"Retry-After": "1"})) as url:
        started = time.monotonic()
        code, report = smoke(url, tmp_path / "r.json", startup_timeout=2.5)
        elapsed = time.monotonic() - started
    assert code == 1
    assert elapsed < 10
    assert report["ready"] is False and report["passed"] is False
    assert report["startup"]["last_status"] == 503 and report["startup"]["polls"] >= 2
    assert 1.5 <= report["startup_wait_s"] <= 4.0
    assert report["checks"] == []


def test_smoke_waits_out_startup_503s_and_reports_the_wait(tmp_path: Path) -> None:
    api = FakeApi(ready_after=1.5)
    with stub_server(api.handle) as url:
        code, report = smoke(url, tmp_path / "r.json", allow_weak_model=True, startup_timeout=30)
    assert code == 0, failures(report)
    assert report["startup_wait_s"] >= 1.0 and report["startup"]["polls"] >= 2


def test_a_useless_model_fails_the_semantic_checks_unless_a_weak_model_is_allowed(tmp_path: Path) -> None:
    with stub_server(FakeApi().handle) as url:
        strict, strict_report = smoke(url, tmp_path / "strict.json")
        weak, weak_report = smoke(url, tmp_path / "weak.json", allow_weak_model=True)
    assert strict == 1 and weak == 0
    for report, semantic_outcome in ((strict_report, "fail"), (weak_report, "recorded")):
        checks = by_name(report)
        assert {checks[name]["outcome"] for name in SEMANTIC_CHECKS} == {semantic_outcome}
        # The many-option checks hold the contract but miss the obvious target: semantic misses too.
        assert checks["choice_255_options"]["outcome"] == semantic_outcome
        assert checks["multi_question"]["outcome"] == "pass"
        assert checks["noul"]["cached_tokens"] is None and checks["noul"]["prefix_tokens"] == 12


def test_async_check_fails_when_the_server_has_no_jobs_api(tmp_path: Path) -> None:
    with stub_server(FakeApi(jobs=False).handle) as url:
        code, report = smoke(url, tmp_path / "r.json", allow_weak_model=True)
    assert code == 1
    assert failures(report) == [f"async_job: {by_name(report)['async_job']['detail']}"]
    assert by_name(report)["async_job"]["status"] == 404


def test_a_missing_key_variable_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENJEV_SMOKE_TEST_KEY", raising=False)
    assert run_smoke("http://127.0.0.1:9", key_env="OPENJEV_SMOKE_TEST_KEY", out=tmp_path / "r.json") == 2


def test_the_key_from_the_named_variable_is_sent_as_a_bearer_token(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENJEV_SMOKE_TEST_KEY", "s3cret")
    api = FakeApi()
    with stub_server(api.handle) as url:
        smoke(url, tmp_path / "r.json", key_env="OPENJEV_SMOKE_TEST_KEY", allow_weak_model=True)
    assert api.authorizations == {"Bearer s3cret"}


def test_many_options_are_distinct_with_one_described_target_in_the_middle() -> None:
    options = many_options(255)
    assert len(options) == 255
    assert list(options).index(TARGET_OPTION[0]) == 127
    assert [name for name, description in options.items() if description] == [TARGET_OPTION[0]]


def test_response_problems_catch_contract_breaks() -> None:
    question = {"type": "choice", "criteria": {"A": None, "B": None}}
    good = {"model": "m", "usage": {"input_tokens": 3, "output_tokens": 1}, "answers": {"q": {
        "type": "choice", "choice": "A", "probabilities": {"A": 0.75, "B": 0.25}, "confidence": 0.5}}}
    assert response_problems(good, {"q": question}) == []
    skewed = json.loads(json.dumps(good))
    skewed["answers"]["q"]["probabilities"]["B"] = 0.5
    assert any("sum" in p for p in response_problems(skewed, {"q": question}))
    extra = {**good, "id": "x"}
    assert any("'id'" in p for p in response_problems(extra, {"q": question}))
    assert response_problems({**good, "answers": {}}, {"q": question})


class Handler(BaseHTTPRequestHandler):
    """Routes every request to the stub's `respond(handler)`."""

    respond: Callable[[Handler], None]

    def do_GET(self) -> None:
        self.respond(self)

    do_POST = do_DELETE = do_GET

    def body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                            **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def stub_server(respond: Callable[[Handler], None]) -> Iterator[str]:
    """An HTTP server on a loopback port, in a thread, answering with `respond`; yields its URL."""
    handler = type("StubHandler", (Handler,), {"respond": staticmethod(respond)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class FakeApi:
    """The contract's shapes with near-uniform answers: a model that knows nothing, and no cache report."""

    def __init__(self, ready_after: float = 0.0, jobs: bool = True) -> None:
        self.ready_at = time.monotonic() + ready_after
        self.jobs = jobs
        self.results: dict[str, Any] = {}
        self.authorizations: set[str] = set()

    def handle(self, request: Handler) -> None:
        self.authorizations.add(request.headers.get("Authorization", ""))
        path = request.path.split("?")[0]
        if time.monotonic() < self.ready_at:
            request.reply(503, {"detail": {"error_type": "unavailable", "message": "starting"}}, {"Retry-After": "1"})
        elif path == "/health":
            request.reply(200, {"status": "ok"})
        elif path == "/v1/limits":
            request.reply(200, {"max_options": 255})
        elif path == "/v1/models":
            request.reply(200, {"models": [{"name": "fake", "description": "", "release_date": "2026-01-01"}]})
        elif path == "/v1/systemone":
            self._evaluate(request, request.body())
        elif path.startswith("/v1/jobs") and self.jobs:
            self._job(request, path)
        else:
            request.reply(404, {"detail": {"error_type": "not_found", "message": path}})

    def _evaluate(self, request: Handler, body: dict[str, Any]) -> None:
        if any(len(q.get("criteria") or ()) > 255 for q in body["questions"].values()):
            request.reply(422, {"detail": [{"loc": ["body"], "msg": "too many options", "type": "value_error"}]})
            return
        request.reply(200, uniform_response(body), {"x-openjev-prefix-tokens": "12"})

    def _job(self, request: Handler, path: str) -> None:
        if request.command == "POST":
            job_id = f"job{len(self.results)}"
            self.results[job_id] = uniform_response(request.body())
            request.reply(202, {"id": job_id, "status": "queued"}, {"Location": f"/v1/jobs/{job_id}"})
            return
        job_id = path.rsplit("/", 1)[-1]
        request.reply(200, {"id": job_id, "status": "succeeded", "result": self.results[job_id]})


def uniform_response(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": "fake", "usage": {"input_tokens": 20, "output_tokens": len(body["questions"])},
            "answers": {qid: uniform_answer(q) for qid, q in body["questions"].items()}}


def uniform_answer(question: dict[str, Any]) -> dict[str, Any]:
    if question["type"] == "noul":
        return {"type": "noul", "noul": 0.5}
    if question["type"] == "choice":
        # A slight lean to the last option: never the target the smoke test puts first or in the middle.
        names = list(question["criteria"])
        probabilities = {name: (2 if name == names[-1] else 1) / (len(names) + 1) for name in names}
        return {"type": "choice", "choice": names[-1], "probabilities": probabilities, "confidence": 0.01}
    levels = question["criteria"]
    p = 1 / len(levels)
    return {"type": "score", "score": sum(i * p for i in range(len(levels))), "confidence": 0.0,
            "legend": {str(i): level for i, level in enumerate(levels)},
            "probabilities": {str(i): p for i in range(len(levels))}}
