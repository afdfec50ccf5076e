"""The contract's edges, as real clients and fuzzers found them: pinned model names, input that once
gave a 500, the seed's strictness, and JSON or framing that would be silently reinterpreted. Each
gets a 4xx naming what is wrong, through real API, Redis and worker processes (scripted engine)."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
import zstandard

from common.prompt import state_messages
from common.settings import Settings
from harness.stacks import Stack
from harness.web import web

NOUL = {"type": "noul", "instructions": "Refund?"}


def body(questions: dict | None = None, **fields) -> dict:
    return {"model": "jev-latest", "state": "I was charged twice.", "questions": questions or {"q": NOUL}, **fields}


def post_raw(stack: Stack, raw: bytes, path: str = "/v1/systemone", **headers: str) -> httpx.Response:
    return web.post(stack.url + path, content=raw, timeout=60,
                    headers={"Content-Type": "application/json", **headers})


def assert_refused(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["x-typesafe-request-id"].startswith("req_")
    text = json.dumps(r.json())
    for word in words:
        assert word in text, (word, text)


@pytest.fixture(autouse=True)
def _plain_script(scripted_stack: Stack):
    scripted_stack.script(delay=0.0, fail_rid_suffix=None, fail_status=500, fail_delay=0.0, report_cached=True)


# --- model names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["jev-1.13.0", "jev-preview", "jev-latest"])
def test_pinned_jev_model_names_are_answered_by_the_served_model(scripted_stack: Stack, name: str) -> None:
    r = scripted_stack.post(body(model=name))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == scripted_stack.env["OPENJEV_SERVED_MODEL_NAME"]


def test_model_aliases_setting_narrows_the_accepted_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENJEV_MODEL_ALIASES", "jev-latest, jev-1.13.0")
    settings = Settings()
    assert settings.accepts_model("jev-1.13.0") and settings.accepts_model("jev-latest")
    assert not settings.accepts_model("jev-preview")
    assert settings.accepts_model(settings.served_model_name)
    assert settings.listed_model_names == [settings.served_model_name, "jev-latest", "jev-1.13.0"]
    assert Settings(model_aliases="jev-*").accepts_model("jev-preview")


def test_a_name_outside_jev_is_still_an_unknown_model(scripted_stack: Stack) -> None:
    assert_refused(scripted_stack.post(body(model="gpt-4o")), 400, "Unknown model: gpt-4o")


# --- input that once gave a 500 ------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    b'{"model":"jev-latest","state":"s","questions":{"\\udfff":{"type":"noul"}}}',
    b'{"model":"jev-latest","state":"s","questions":{"q":{"type":"choice","criteria":{"\\ud800x":null,"b":null}}}}',
    b'{"model":"jev-\\udfff","state":"s","questions":{"q":{"type":"noul"}}}',
    b'{"model":"jev-latest","state":"s","questions":{"q":{"type":"\\udfff"}}}',
], ids=["question-id", "option-name", "model", "type"])
def test_lone_surrogates_get_422_naming_the_field(scripted_stack: Stack, raw: bytes) -> None:
    r = post_raw(scripted_stack, raw)
    assert_refused(r, 422, "unpaired UTF-16 surrogate")
    assert r.json()["detail"][0]["loc"][0] == "body"


def nested(depth: int) -> object:
    value: object = "deep"
    for _ in range(depth):
        value = {"level": [value]}
    return value


def test_a_score_level_nested_200_deep_is_422(scripted_stack: Stack) -> None:
    levels = ["calm", nested(100)]  # 200 levels of objects and arrays
    assert_refused(scripted_stack.post(body({"s": {"type": "score", "criteria": levels}})), 422, "nested deeper")


@pytest.mark.parametrize("where", ["state", "instructions", "level"])
def test_deep_nesting_with_an_idempotency_key_is_422(scripted_stack: Stack, where: str) -> None:
    deep = nested(100)
    request = {"state": body(state=deep), "instructions": body({"q": {**NOUL, "instructions": deep}}),
               "level": body({"q": {"type": "score", "criteria": ["a", deep]}})}[where]
    r = scripted_stack.post(request, path="/v1/jobs", headers={"Idempotency-Key": f"deep-{where}"})
    assert_refused(r, 422, "nested deeper than 64 levels")


def test_nesting_within_the_limit_is_answered(scripted_stack: Stack) -> None:
    r = scripted_stack.post(body({"s": {"type": "score", "criteria": ["calm", nested(20)]}}))
    assert r.status_code == 200, r.text
    assert r.json()["answers"]["s"]["legend"]["1"] == nested(20)


# --- strict where the seed is strict -------------------------------------------------------------


def test_an_unknown_message_role_is_422_naming_the_role(scripted_stack: Stack) -> None:
    state = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    r = scripted_stack.post(body(state=state))
    assert_refused(r, 422, "'wizard' is not a chat role")
    assert r.json()["detail"][0]["loc"] == ["body", "state", 1, "role"]


def test_tool_turns_are_rendered_through_the_template_not_serialised() -> None:
    state = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
             {"role": "tool", "content": "12 °C, rain"}]
    assert state_messages(state) == state
    assert state_messages({"messages": state}) == state


def test_a_tool_turn_is_answered(scripted_stack: Stack) -> None:
    state = [{"role": "user", "content": "Refund me"}, {"role": "tool", "content": "order 42: refunded"}]
    assert scripted_stack.post(body(state=state)).status_code == 200


@pytest.mark.parametrize("state", [42, 4.5, True, False, None], ids=repr)
def test_state_must_be_a_string_object_or_array(scripted_stack: Stack, state: object) -> None:
    assert_refused(scripted_stack.post(body(state=state)), 422, "must be a string, an object or an array")


@pytest.mark.parametrize("raw", [
    b'{"model":"jev-latest","state":"s","questions":{"q":{"type":"noul"},"q":{"type":"score","criteria":["a","b"]}}}',
    b'{"model":"jev-latest","state":"s","questions":{"q":{"type":"choice","criteria":{"A":"x","A":"y"}}}}',
    b'{"model":"jev-latest","model":"jev-latest","state":"s","questions":{"q":{"type":"noul"}}}',
], ids=["question-id", "option-name", "top-level"])
def test_duplicate_keys_are_refused_not_last_one_wins(scripted_stack: Stack, raw: bytes) -> None:
    assert_refused(post_raw(scripted_stack, raw), 422, "appears more than once")


RAW = json.dumps(body()).encode()
ONE_FRAME = zstandard.ZstdCompressor().compress(RAW)


@pytest.mark.parametrize(("encoding", "data", "words"), [
    ("gzip", gzip.compress(RAW) + gzip.compress(RAW), "follow the gzip member"),
    ("gzip", gzip.compress(RAW) + b"trailing", "follow the gzip member"),
    ("gzip", gzip.compress(RAW)[:-6], "truncated"),
    ("zstd", ONE_FRAME + ONE_FRAME, "follow the zstd frame"),
    ("zstd", ONE_FRAME[:-4], "truncated"),
], ids=["second-gzip-member", "bytes-after-gzip", "truncated-gzip", "second-zstd-frame", "truncated-zstd"])
def test_compressed_bodies_are_exactly_one_complete_member_or_frame(scripted_stack: Stack, encoding: str,
                                                                    data: bytes, words: str) -> None:
    assert_refused(post_raw(scripted_stack, data, **{"Content-Encoding": encoding}), 400, words)


@pytest.mark.parametrize("level", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"])
def test_non_finite_score_levels_are_refused_since_the_legend_echoes_them(scripted_stack: Stack,
                                                                          level: bytes) -> None:
    raw = (b'{"model":"jev-latest","state":"s","questions":{"s":{"type":"score","criteria":["low",'
           + level + b']}}}')
    r = post_raw(scripted_stack, raw)
    assert_refused(r, 422, "is not a finite number")
    assert r.json()["detail"][0]["loc"] == ["body", "questions", "s", "criteria", 1]


def test_score_levels_come_back_exactly_or_are_refused(scripted_stack: Stack) -> None:
    exact = ["low", 1.5, 2**63, -(2**63), {"x": [True, None, "é"]}]
    r = scripted_stack.post(body({"s": {"type": "score", "criteria": exact}}))
    assert r.status_code == 200, r.text
    assert r.json()["answers"]["s"]["legend"] == {str(i): level for i, level in enumerate(exact)}
    too_big = scripted_stack.post(body({"s": {"type": "score", "criteria": ["low", {"n": 2**64}]}}))
    assert_refused(too_big, 422, "beyond 64 bits")


def test_large_integers_in_the_state_are_kept_whole(scripted_stack: Stack) -> None:
    assert scripted_stack.post(body(state={"order": 2**80})).status_code == 200


def test_405_names_every_method_of_the_path_including_delete(scripted_stack: Stack) -> None:
    r = web.request("PUT", scripted_stack.url + "/v1/jobs/job_x", timeout=10)
    assert r.status_code == 405
    assert r.headers["allow"] == "DELETE, GET"
    assert web.request("PATCH", scripted_stack.url + "/v1/systemone", timeout=10).headers["allow"] == "POST"
