"""A job's branches go to the engine in batched /generate calls (SGLang's list form) and the real CPU
engine computes each batch in one pass; the answers are those of the unbatched path (one call per branch,
`OPENJEV_BRANCH_BATCH_SIZE=1`), up to float rounding, through real API, Redis, worker and engine: in
float32 (the tests' dtype) to 1e-4, and in bfloat16 (what `auto` picks on CPUs with bf16 instructions) to
the rounding of a packed pass (BF16_TOLERANCE), with the same top answer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import start_cpu_engine
from harness.stacks import Stack, build_stack, model_cache_dir
from harness.web import web
from openjev.embedded_redis import start_redis
from tests.conftest import FIGURES
from tests.test_integration import EXTRA, QUESTIONS, TICKET, numbers

pytestmark = pytest.mark.integration

SCORE5 = {"type": "score", "instructions": "How urgent is it?", "criteria": ["1", "2", "3", "4", "5"]}
ALL_KINDS = {**QUESTIONS, **EXTRA, "urgency": SCORE5}
# In bfloat16 a packed pass (all branches in one batch) rounds otherwise than one branch at a time: the
# hidden states differ in their last bits, and the probabilities by up to a few hundredths (on an AVX2 host,
# which emulates bfloat16: 0.0174 and 0.0214 for two ticket numbers; a 0.02 bound failed CI once).
BF16_TOLERANCE = 0.03


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


@pytest.fixture(scope="module")
def bf16_stacks(model_dir: Path, log_dir: Path) -> Iterator[tuple[Stack, Stack]]:
    """A bfloat16 CPU engine and two stacks on it, each on its own Redis: batched (the default) and one
    engine call per branch."""
    engine = start_cpu_engine(log_dir, model_cache_dir(), dtype="bfloat16")
    servers: list = []
    stacks: list[Stack] = []
    try:  # whatever fails to start, what did start is stopped
        servers += [start_redis() for _ in range(2)]
        stacks.append(build_stack(servers[0][1], engine, model_dir, log_dir))
        stacks.append(build_stack(servers[1][1], engine, model_dir, log_dir, OPENJEV_BRANCH_BATCH_SIZE="1"))
        yield stacks[0], stacks[1]
    finally:
        for stack in stacks:
            for proc in (stack.api, *stack.workers):
                proc.stop()
        engine.stop()
        for process, _ in servers:
            process.terminate()
            process.wait(10)


def forward_passes(stack: Stack) -> int:
    return web.get(f"{stack.engine.url}/stats", timeout=5).json()["forward_passes"]


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


def test_in_bfloat16_batched_answers_are_the_unbatched_answers_to_its_rounding(bf16_stacks: tuple[Stack, Stack],
                                                                               request: pytest.FixtureRequest) -> None:
    batched_stack, unbatched_stack = bf16_stacks
    assert "bfloat16" in batched_stack.engine.output()  # the engine says what it loaded
    # One fixed state: the engine is this test's own, so nothing is cached, and the rounding is the same run to run.
    state = f"{TICKET} (ticket 5c1e0b7a)"
    before = forward_passes(batched_stack)
    batched = ask(batched_stack, state)
    assert forward_passes(batched_stack) - before == 2  # the warm call, then every branch in one packed pass
    before = forward_passes(batched_stack)
    one_by_one = ask(unbatched_stack, state)
    assert forward_passes(batched_stack) - before == 1 + len(ALL_KINDS)
    assert batched["usage"] == one_by_one["usage"]
    assert list(batched["answers"]) == list(one_by_one["answers"]) == list(ALL_KINDS)
    largest = max(abs(a - b) for qid, answer in batched["answers"].items()
                  for a, b in zip(numbers(answer), numbers(one_by_one["answers"][qid]), strict=True))
    request.config.stash.setdefault(FIGURES, []).append(
        f"bfloat16 CPU engine: batched and unbatched answers differ by at most {largest:.5f}")
    for qid, answer in batched["answers"].items():
        reference = one_by_one["answers"][qid]
        assert answer["type"] == reference["type"]
        assert numbers(answer) == pytest.approx(numbers(reference), abs=BF16_TOLERANCE)
        if answer["type"] == "choice":
            ranked = sorted(numbers(reference), reverse=True)
            if ranked[0] - ranked[1] > 2 * BF16_TOLERANCE:  # a clear top answer is the same top answer
                assert answer["choice"] == reference["choice"]
