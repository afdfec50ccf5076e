"""Engine output is never trusted blindly: an answer with non-finite or impossible label logprobs, a
`meta_info` that is not an object or lacks `prompt_tokens`, or a body too big (or endless) to be an
answer fails the job with 502 `engine_error`, through real API, Redis and worker processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.contract import EXAMPLE_REQUEST
from harness.processes import start_scripted_engine
from harness.scripted_engine import BAD_ANSWERS
from harness.stacks import Stack, build_stack

ONE_QUESTION = {"model": "jev-latest", "state": "I was charged twice.",
                "questions": {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}}


@pytest.fixture(scope="module")
def stack(redis_server: str, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """A scripted stack with a short request deadline: an engine answer that never ends must not
    hide behind the default 120 s."""
    stack = build_stack(redis_server, start_scripted_engine(log_dir), model_dir, log_dir,
                        OPENJEV_REQUEST_TIMEOUT="30")
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def _honest_engine(stack: Stack) -> Iterator[None]:
    stack.script(bad_answer=None)
    yield
    stack.script(bad_answer=None)


@pytest.mark.parametrize("request_body", [ONE_QUESTION, EXAMPLE_REQUEST], ids=["single", "batched"])
@pytest.mark.parametrize("kind", BAD_ANSWERS)
def test_untrustworthy_engine_output_is_502_engine_error(stack: Stack, kind: str, request_body: dict) -> None:
    assert stack.post(request_body).status_code == 200  # the same request is fine from an honest engine
    stack.script(bad_answer=kind)
    started = time.monotonic()
    r = stack.post(request_body)
    assert r.status_code == 502, r.text
    assert r.json()["detail"]["error_type"] == "engine_error"
    assert r.json()["detail"]["message"]
    assert time.monotonic() - started < 15  # a bounded read, not the deadline
