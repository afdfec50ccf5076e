"""A job's branches go to the engine in batched /generate calls (SGLang's list form) and the real CPU
engine computes each batch in one pass; the answers are those of the unbatched path (one call per branch,
`OPENJEV_BRANCH_BATCH_SIZE=1`), up to float rounding, through real API, Redis, worker and engine."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from openjev.embedded_redis import start_redis
from tests.conftest import Stack, build_stack
from tests.test_integration import EXTRA, QUESTIONS, TICKET, numbers

pytestmark = pytest.mark.integration

SCORE5 = {"type": "score", "instructions": "How urgent is it?", "criteria": ["1", "2", "3", "4", "5"]}
ALL_KINDS = {**QUESTIONS, **EXTRA, "urgency": SCORE5}


@pytest.fixture(scope="module")
def unbatched_stack(cpu_stack: Stack, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """A second API and worker on their own Redis, one engine call per branch, sharing cpu_stack's engine."""
    process, redis_url = start_redis()
    stack = build_stack(redis_url, cpu_stack.engine, model_dir, log_dir, OPENJEV_BRANCH_BATCH_SIZE="1")
    yield stack
    for proc in (stack.api, *stack.workers):
        proc.stop()
    process.terminate()
    process.wait(10)


def forward_passes(stack: Stack) -> int:
    return httpx.get(f"{stack.engine.url}/stats", timeout=5).json()["forward_passes"]


def ask(stack: Stack, state: str) -> dict:
    r = stack.post({"model": "jev-latest", "state": state, "questions": ALL_KINDS}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("extra", ["", " Also, my account shows the wrong address."])
def test_batched_answers_are_the_unbatched_answers(cpu_stack: Stack, unbatched_stack: Stack, extra: str) -> None:
    # a state no other test sends, so no branch prompt is cached yet (the engine is shared across tests);
    # the batched path goes first: once a prompt is cached whole, the engine computes a batch prompt by prompt
    state = f"{TICKET}{extra} (ticket {uuid.uuid4().hex[:8]})"
    before = forward_passes(cpu_stack)
    batched = ask(cpu_stack, state)
    assert forward_passes(cpu_stack) - before == 2  # the warm call, then every branch in one packed pass
    before = forward_passes(cpu_stack)
    one_by_one = ask(unbatched_stack, state)
    assert forward_passes(cpu_stack) - before == 1 + len(ALL_KINDS)  # the warm call, then one per branch
    assert batched["usage"] == one_by_one["usage"]
    assert list(batched["answers"]) == list(one_by_one["answers"]) == list(ALL_KINDS)
    for qid, answer in batched["answers"].items():
        reference = one_by_one["answers"][qid]
        assert answer["type"] == reference["type"]
        assert numbers(answer) == pytest.approx(numbers(reference), abs=1e-4)
        assert {k: v for k, v in answer.items() if not isinstance(v, float | dict)} == \
            {k: v for k, v in reference.items() if not isinstance(v, float | dict)}
