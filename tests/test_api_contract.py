"""The wire contract, end to end through real processes (API, Redis, worker) with the scripted
engine, which reports every call it received."""

from __future__ import annotations

import gzip
import math

import orjson
import pytest
import zstandard

from common.contract import EXAMPLE_REQUEST
from harness.processes import start_api
from harness.stacks import Stack
from harness.web import web

NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"Billing": "Payments", "Technical": None}}
SCORE = {"type": "score", "instructions": "How angry?", "criteria": ["Calm", "Frustrated", "Very angry"]}


def body(questions: dict | None = None, **extra) -> dict:
    return {"model": "jev-latest", "state": "I was charged twice.", "questions": questions or {"q": NOUL}, **extra}


@pytest.fixture(autouse=True)
def _reset_script(scripted_stack: Stack):
    scripted_stack.script(delay=0.0, fail_rid_suffix=None, fail_status=500, fail_delay=0.0, report_cached=True)
    yield


def test_example_request_gets_three_answers_with_exact_key_sets(scripted_stack: Stack) -> None:
    r = scripted_stack.post(EXAMPLE_REQUEST)
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data) == {"model", "answers", "usage"}
    answers = data["answers"]
    assert list(answers) == ["refund", "department", "urgency"]
    strip = lambda a: {k for k in a if not k.startswith("x_")}  # noqa: E731
    assert strip(answers["refund"]) == {"type", "noul"}
    assert strip(answers["department"]) == {"type", "choice", "probabilities", "confidence"}
    assert strip(answers["urgency"]) == {"type", "score", "legend", "probabilities", "confidence"}


def test_choice_probabilities_keep_option_names_and_follow_the_official_confidence(scripted_stack: Stack) -> None:
    options = {"환불 요청": "money back", "🙂 기타": None, "with space": "other"}
    r = scripted_stack.post(body({"team": {"type": "choice", "criteria": options}}))
    answer = r.json()["answers"]["team"]
    assert list(answer["probabilities"]) == list(options)
    assert math.isclose(sum(answer["probabilities"].values()), 1.0, abs_tol=1e-9)
    top = max(answer["probabilities"].values())
    assert answer["choice"] == max(answer["probabilities"], key=answer["probabilities"].get)
    assert math.isclose(answer["confidence"], (top - 1 / 3) / (1 - 1 / 3), abs_tol=1e-9)


def test_score_is_the_expected_level_and_legend_echoes_levels(scripted_stack: Stack) -> None:
    levels = ["Calm", {"label": "Frustrated"}, ["Very", "angry"]]
    r = scripted_stack.post(body({"s": {"type": "score", "criteria": levels}}))
    answer = r.json()["answers"]["s"]
    assert answer["legend"] == {"0": levels[0], "1": levels[1], "2": levels[2]}
    p = answer["probabilities"]
    assert list(p) == ["0", "1", "2"]
    assert math.isclose(answer["score"], sum(i * p[str(i)] for i in range(3)), abs_tol=1e-9)
    k = max(range(3), key=lambda i: p[str(i)])
    spread = sum(abs(i - 1) for i in range(3)) / 3
    expected = max(0.0, 1 - sum(p[str(i)] * abs(i - k) for i in range(3)) / spread)
    assert math.isclose(answer["confidence"], expected, abs_tol=1e-9)


def test_usage_counts_every_prompt_token_sent_and_one_output_token_per_call(scripted_stack: Stack) -> None:
    before = scripted_stack.engine_stats()
    r = scripted_stack.post(body({"a": NOUL, "b": CHOICE, "c": SCORE}))
    after = scripted_stack.engine_stats()
    usage = r.json()["usage"]
    assert usage["output_tokens"] == 4
    assert usage["input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    prefix = int(r.headers["x-openjev-prefix-tokens"])
    assert usage["input_tokens"] > 4 * prefix


def test_headers_report_prefix_cached_tokens_and_server_timing(scripted_stack: Stack) -> None:
    r = scripted_stack.post(body({"a": NOUL, "b": SCORE}))
    prefix = int(r.headers["x-openjev-prefix-tokens"])
    assert int(r.headers["x-openjev-cached-tokens"]) >= 2 * prefix  # the warm call cached the prefix
    timing = r.headers["server-timing"]
    for stage in ("queue", "prepare", "prefill", "branches"):
        assert f"{stage};dur=" in timing
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_cached_tokens_header_is_absent_not_zero_when_the_engine_does_not_report(scripted_stack: Stack) -> None:
    scripted_stack.script(report_cached=False)
    r = scripted_stack.post(body())
    assert r.status_code == 200
    assert "x-openjev-cached-tokens" not in r.headers


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_compressed_bodies_are_decompressed(scripted_stack: Stack, encoding: str) -> None:
    raw = orjson.dumps(body(state="charged twice " * 200))
    data = zstandard.ZstdCompressor().compress(raw) if encoding == "zstd" else gzip.compress(raw)
    r = web.post(scripted_stack.url + "/v1/systemone", content=data, timeout=60,
                 headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status_code == 200, r.text
    assert set(r.json()["answers"]) == {"q"}


def test_body_over_the_limit_is_413_even_when_compressed_small(scripted_stack: Stack) -> None:
    big = orjson.dumps(body(state="x" * (3 * 1024 * 1024)))
    r = web.post(scripted_stack.url + "/v1/systemone", content=big, timeout=60,
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["detail"]["error_type"] == "request_too_large"
    packed = zstandard.ZstdCompressor().compress(big)
    assert len(packed) < 100_000
    r = web.post(scripted_stack.url + "/v1/systemone", content=packed, timeout=60,
                 headers={"Content-Type": "application/json", "Content-Encoding": "zstd"})
    assert r.status_code == 413
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_unknown_top_level_and_question_fields_are_ignored(scripted_stack: Stack) -> None:
    r = scripted_stack.post(body({"q": {**NOUL, "x_hint": 1}}, x_trace_id="t", seed=7))
    assert r.status_code == 200, r.text


def test_unknown_model_is_400_with_the_error_shape(scripted_stack: Stack) -> None:
    r = scripted_stack.post({**body(), "model": "gpt-nope"})
    assert r.status_code == 400
    name = scripted_stack.env["OPENJEV_SERVED_MODEL_NAME"]
    accepted = f"`{name}`, `jev-latest`; any name beginning `jev-` (a pinned version such as `jev-1.13.0` too)"
    assert r.json() == {"detail": {"error_type": "api_usage_error", "message": f"Unknown model: gpt-nope. This "
                                   f"server accepts {accepted}; GET /v1/models lists them"}}
    assert r.headers["content-type"].startswith("application/json")


def test_the_served_model_name_is_accepted_and_reported(scripted_stack: Stack) -> None:
    name = scripted_stack.env["OPENJEV_SERVED_MODEL_NAME"]
    r = scripted_stack.post({**body(), "model": name})
    assert r.status_code == 200
    assert r.json()["model"] == name


INVALID = {
    "missing-state": {"model": "jev-latest", "questions": {"q": NOUL}},
    "null-state": {"model": "jev-latest", "state": None, "questions": {"q": NOUL}},
    "missing-questions": {"model": "jev-latest", "state": "x"},
    "empty-questions": body({}) | {"questions": {}},
    "missing-type": body({"q": {"instructions": "Refund?"}}),
    "type-boolean": body({"q": {"type": "boolean"}}),
    "choice-no-options": body({"q": {"type": "choice", "criteria": {}}}),
    "choice-list": body({"q": {"type": "choice", "criteria": ["a", "b"]}}),
    "score-map": body({"q": {"type": "score", "criteria": {"0": "a", "1": "b"}}}),
    "score-null-level": body({"q": {"type": "score", "criteria": ["Calm", None]}}),
    "score-one-level": body({"q": {"type": "score", "criteria": ["Calm"]}}),
    "too-many-options": body({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}),
    "too-many-questions": body({f"q{i}": NOUL for i in range(65)}),
    "image-content": body() | {"state": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    "over-token-budget": body() | {"state": "refund please " * 20000},
    "questions-not-object": body() | {"questions": ["q"]},
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_get_a_documented_4xx_before_any_engine_call(scripted_stack: Stack, case: str) -> None:
    before = scripted_stack.engine_stats()["requests_received"]
    r = scripted_stack.post(INVALID[case])
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail[0]["loc"][0] == "body" and detail[0]["msg"]
    assert scripted_stack.engine_stats()["requests_received"] == before


def test_malformed_json_is_422_not_5xx(scripted_stack: Stack) -> None:
    r = web.post(scripted_stack.url + "/v1/systemone", content=b'{"model": "jev-latest", "state": "x", "q',
                 headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 422
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_a_failed_branch_cancels_and_aborts_its_siblings_in_the_engine(scripted_stack: Stack) -> None:
    # b1 fails once its siblings are surely live in the engine (aborts of unknown rids do nothing), with a 400:
    # a fault of the request, so the job fails at once (a 5xx would run it again: test_engine_failures.py)
    scripted_stack.script(delay=5.0, fail_rid_suffix=".b1", fail_status=400, fail_delay=1.0)
    before = scripted_stack.engine_stats()
    r = scripted_stack.post(body({"a": NOUL, "b": NOUL, "c": NOUL, "d": NOUL}))
    assert r.status_code == 502
    assert r.json()["detail"]["error_type"] == "engine_error"
    after = scripted_stack.engine_stats()
    # the warm call finished after its delay; b1 failed; b0, b2, b3 were live and got aborted
    assert after["requests_aborted"] - before["requests_aborted"] == 3
    assert after["aborts_received"] - before["aborts_received"] >= 3
    assert after["live"] == []


def test_models_limits_health_and_docs_routes(scripted_stack: Stack) -> None:
    models = web.get(scripted_stack.url + "/v1/models").json()["models"]
    assert models[0]["name"] == scripted_stack.env["OPENJEV_SERVED_MODEL_NAME"]
    assert all(set(m) == {"name", "description", "release_date"} for m in models)
    limits = web.get(scripted_stack.url + "/v1/limits").json()
    assert limits["max_options"] >= 26 and limits["max_questions"] == 64 and limits["live_workers"] == 1
    assert limits["tenant"]["name"] == "default" and limits["tenant"]["queue_share"] is None  # the queue is its own
    health = web.get(scripted_stack.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert web.get(scripted_stack.url + "/health/live").json() == {"status": "ok"}
    for path in ("/", "/docs", "/openapi.json"):
        assert web.get(scripted_stack.url + path).status_code == 200
    missing = web.get(scripted_stack.url + "/nope")
    assert missing.status_code == 404 and missing.json()["detail"]["error_type"] == "not_found_error"


@pytest.fixture(scope="module")
def keyed_api(scripted_stack: Stack):
    api = start_api(scripted_stack.log_dir, {**scripted_stack.env, "OPENJEV_API_KEY": "s3cret-key"})
    yield api
    api.stop()


def test_auth_missing_key_is_403_wrong_key_401_bearer_only(keyed_api) -> None:
    url = keyed_api.url + "/v1/systemone"
    missing = web.post(url, json=body(), timeout=30)
    assert missing.status_code == 403 and missing.json()["detail"]["error_type"] == "authentication_error"
    wrong = web.post(url, json=body(), headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["detail"]["error_type"] == "authentication_error"
    other_header = web.post(url, json=body(), headers={"x-api-key": "s3cret-key"}, timeout=30)
    assert other_header.status_code == 403
    ok = web.post(url, json=body(), headers={"Authorization": "Bearer s3cret-key"}, timeout=30)
    assert ok.status_code == 200
    assert web.get(keyed_api.url + "/health").status_code == 200
    assert web.get(keyed_api.url + "/v1/models").status_code == 403


def test_auth_off_accepts_and_ignores_any_authorization_header(scripted_stack: Stack) -> None:
    r = scripted_stack.post(body(), headers={"Authorization": "Bearer whatever"})
    assert r.status_code == 200


def test_the_readme_example_file_is_the_documented_example() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "request.json"
    assert orjson.loads(example.read_bytes()) == EXAMPLE_REQUEST
