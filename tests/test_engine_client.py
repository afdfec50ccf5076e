"""The worker's engine client against answers captured from a real SGLang 0.5.23 (both HTTP
frontends, `tests/data/sglang-0.5.23-cpu/`), replayed over HTTP by the scripted engine: aborts in
every form either frontend gives them, the three error body shapes, and label logprobs and cached
tokens read from real answers. The same paths against a live SGLang: `tests/test_sglang_real.py`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from harness.processes import Proc, start_scripted_engine
from harness.web import web
from openjev.embedded_redis import free_port
from worker.engine_client import BranchPrompt, EngineAborted, EngineClient, EngineError, GenerateResult, SharedPrefix

CAPTURED = Path(__file__).parent / "data" / "sglang-0.5.23-cpu"
FRONTENDS = ("python", "rust")
REPLAYED = ".replayed"  # rids ending with this get the scripted answer


def captured(frontend: str, case: str) -> dict[str, Any]:
    return json.loads((CAPTURED / f"{frontend}-frontend.json").read_text())[case]


@pytest.fixture(scope="module")
def engine(log_dir: Path) -> Iterator[Proc]:
    proc = start_scripted_engine(log_dir)
    yield proc
    proc.stop()


@pytest_asyncio.fixture(loop_scope="function")
async def client(engine: Proc) -> AsyncIterator[EngineClient]:
    assert engine.url
    script(engine, fail_rid_suffix=None, fail_body=None, fail_status=500, delay=0.0, register_delay=0.0)
    client = EngineClient(engine.url)
    yield client
    await client.close()


def script(engine: Proc, **settings: Any) -> None:
    web.post(f"{engine.url}/script", json=settings, timeout=5).raise_for_status()


def replay(engine: Proc, frontend: str, case: str) -> dict[str, Any]:
    """Make the engine answer the next replayed call with the captured status and body."""
    answer = captured(frontend, case)
    script(engine, fail_rid_suffix=REPLAYED, fail_status=answer["status"], fail_body=answer["response"])
    return answer


async def score_one(client: EngineClient, input_ids: list[int], labels: list[int], rid: str) -> GenerateResult:
    """One branch call, as the worker sends it for a job with one question."""
    results = await client.score_branches(SharedPrefix(input_ids[:-4]), [BranchPrompt(rid, input_ids[-4:], labels)],
                                          timeout=10)
    return results[0]


async def score(client: EngineClient, labels: list[int] | None = None) -> Any:
    return await score_one(client, list(range(100, 140)), labels or [9805, 787], "job" + REPLAYED)


async def test_rust_frontend_499_client_disconnected_is_an_abort(client: EngineClient, engine: Proc) -> None:
    assert replay(engine, "rust", "aborted_long")["status"] == 499
    with pytest.raises(EngineAborted, match="client disconnected"):
        await score(client)


async def test_rust_frontend_500_truncated_right_after_an_abort_is_an_abort(
        client: EngineClient, engine: Proc) -> None:
    assert replay(engine, "rust", "abort_right_after_call")["status"] == 500
    with pytest.raises(EngineAborted, match="response truncated before completion"):
        await score(client)


async def test_python_frontend_200_with_an_abort_finish_reason_is_an_abort(
        client: EngineClient, engine: Proc) -> None:
    assert replay(engine, "python", "aborted_long")["status"] == 200
    with pytest.raises(EngineAborted, match="Aborted"):
        await score(client)


@pytest.mark.parametrize(("frontend", "case", "message"), [
    ("python", "unknown_sampling_key", "unknown field `bogus`, expected one of"),  # {"error": "..."}
    ("python", "too_long", "The input (8995 tokens) is longer than"),  # {"error": {"message"}}
    ("rust", "too_long", "validation failed: The input (8995 tokens)"),  # {"error": {"message", "code"}}
    ("rust", "label_id_out_of_vocab", "validation failed: token_ids_logprob contains out-of-vocabulary"),
])
async def test_each_error_body_shape_gives_its_message_not_the_json(
        client: EngineClient, engine: Proc, frontend: str, case: str, message: str) -> None:
    replay(engine, frontend, case)
    with pytest.raises(EngineError) as raised:
        await score(client)
    assert not isinstance(raised.value, EngineAborted)
    assert str(raised.value).startswith(f"engine answered 400: {message}")
    assert "{" not in str(raised.value)


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_label_logprobs_and_cached_tokens_are_read_from_a_real_answer(
        client: EngineClient, engine: Proc, frontend: str) -> None:
    answer = replay(engine, frontend, "branch_1")
    labels = answer["request"]["token_ids_logprob"]
    result = await score(client, labels)
    position = answer["response"]["meta_info"]["output_token_ids_logprobs"][0]
    assert result.label_logprobs == [entry[0] for entry in position]
    assert result.prompt_tokens == answer["response"]["meta_info"]["prompt_tokens"] == 114
    # Both frontends of 0.5.23 report cached tokens (the prefix warmed just before: 99 tokens).
    assert result.cached_tokens == answer["response"]["meta_info"]["cached_tokens"] == 99


async def test_an_abort_sent_before_the_engine_registered_the_call_still_aborts_it(
        client: EngineClient, engine: Proc) -> None:
    # SGLang's Python frontend answers such an abort 200 and drops it; the call then runs to the end.
    script(engine, delay=4.0, register_delay=0.8)
    before = stats(engine)
    call = asyncio.create_task(score_one(client, list(range(200, 240)), [49, 50], "early-abort"))
    while stats(engine)["requests_received"] == before["requests_received"]:
        await asyncio.sleep(0.01)
    call.cancel()
    await client.abort("early-abort")  # arrives inside the registration delay: dropped
    after = await settled(engine, before)
    assert after["requests_aborted"] - before["requests_aborted"] == 1
    assert after["requests_finished"] == before["requests_finished"]


def stats(engine: Proc) -> dict[str, Any]:
    return web.get(f"{engine.url}/stats", timeout=5).json()


async def settled(engine: Proc, before: dict[str, Any], timeout: float = 8.0) -> dict[str, Any]:
    """The engine's counters once the call received since `before` has ended, aborted or not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = stats(engine)
        ended = (now["requests_aborted"] + now["requests_finished"]
                 - before["requests_aborted"] - before["requests_finished"])
        if ended:
            return now
        await asyncio.sleep(0.05)
    raise AssertionError(f"the call did not end within {timeout} s")


async def test_transport_failures_map_to_engine_error_and_timeout_error(engine: Proc) -> None:
    """No engine at the address: EngineError (the job's 502); an engine slower than the call's time
    left: TimeoutError (the job's 504); an answer past the byte bound: EngineError, unread."""
    nobody = EngineClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(EngineError, match="engine unreachable"):
            await score_one(nobody, list(range(100, 140)), [9805, 787], "job-nobody")
    finally:
        await nobody.close()
    assert engine.url
    script(engine, fail_rid_suffix=None, fail_body=None, delay=3.0, register_delay=0.0)
    slow = EngineClient(engine.url)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await slow.score_branches(SharedPrefix(list(range(100, 136))),
                                      [BranchPrompt("job-slow", [1, 2, 3], [9805])], timeout=0.5)
        assert time.monotonic() - started < 2.5
    finally:
        script(engine, delay=0.0)
        await slow.close()
    small = EngineClient(engine.url, max_answer_bytes=64)
    try:
        with pytest.raises(EngineError, match="exceeds 64 bytes"):
            await score_one(small, list(range(100, 140)), [9805, 787], "job-small")
    finally:
        await small.close()
