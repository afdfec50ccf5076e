"""The real path: API → Redis/arq → worker → reference CPU engine with SmolLM2-135M-Instruct."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from common.contract import EXAMPLE_REQUEST
from harness.processes import start_api
from harness.stacks import Stack

TICKET = ("Hi, I was charged twice for my March invoice and the refund I was promised still hasn't arrived. "
          "Please fix this today.")
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
             "criteria": {"Billing": "Payments, invoices, refunds", "Technical": "Bugs, outages",
                          "Sales": "Pricing, upgrades"}},
    "anger": {"type": "score", "instructions": "How frustrated is the customer?",
              "criteria": ["Calm", "Frustrated", "Very angry"]},
}
EXTRA = {
    "lang": {"type": "choice", "instructions": "Which language is the ticket in?",
             "criteria": {"English": None, "French": None}},
    "spam": {"type": "noul", "instructions": "Is this spam?"},
}


def ask(stack: Stack, questions: dict) -> httpx.Response:
    r = stack.post({"model": "jev-latest", "state": TICKET, "questions": questions}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def numbers(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"]]
    return list(answer["probabilities"].values())


def assert_same(a: dict, b: dict) -> None:
    assert a["type"] == b["type"]
    assert numbers(a) == pytest.approx(numbers(b), abs=1e-4)


def test_example_request_is_answered_by_the_real_model(cpu_stack: Stack) -> None:
    r = cpu_stack.post(EXAMPLE_REQUEST, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(data["answers"]) == {"refund", "department", "urgency"}
    assert 0.0 <= data["answers"]["refund"]["noul"] <= 1.0
    assert data["answers"]["department"]["choice"] in EXAMPLE_REQUEST["questions"]["department"]["criteria"]
    assert data["usage"]["output_tokens"] == 4


def test_branches_reuse_the_prefix_the_warm_call_cached(cpu_stack: Stack) -> None:
    state = TICKET + " (order #9911, a state this test sends once)"
    r = cpu_stack.post({"model": "jev-latest", "state": state, "questions": QUESTIONS}, timeout=120)
    prefix = int(r.headers["x-openjev-prefix-tokens"])
    cached = int(r.headers["x-openjev-cached-tokens"])
    assert prefix > 20
    assert cached >= len(QUESTIONS) * prefix  # every branch found at least the whole shared prefix cached


def test_answers_do_not_move_when_question_ids_are_renamed(cpu_stack: Stack) -> None:
    base = ask(cpu_stack, QUESTIONS).json()["answers"]
    renamed = ask(cpu_stack, {f"zz {k} 🎯": v for k, v in QUESTIONS.items()}).json()["answers"]
    for k in QUESTIONS:
        assert_same(base[k], renamed[f"zz {k} 🎯"])


def test_answers_do_not_move_when_other_questions_are_added(cpu_stack: Stack) -> None:
    base = ask(cpu_stack, QUESTIONS).json()["answers"]
    more = ask(cpu_stack, {**EXTRA, **QUESTIONS}).json()["answers"]
    for k in QUESTIONS:
        assert_same(base[k], more[k])


def test_answers_do_not_move_when_question_order_is_reversed(cpu_stack: Stack) -> None:
    base = ask(cpu_stack, QUESTIONS).json()["answers"]
    reversed_ = ask(cpu_stack, dict(reversed(list(QUESTIONS.items())))).json()["answers"]
    assert list(reversed_) == list(reversed(list(QUESTIONS)))
    for k in QUESTIONS:
        assert_same(base[k], reversed_[k])


def test_255_option_choice_is_answered_over_every_option(cpu_stack: Stack) -> None:
    options = {f"Queue {i:03d}": None for i in range(255)}
    r = cpu_stack.post({"model": "jev-latest", "state": TICKET,
                        "questions": {"q": {"type": "choice", "criteria": options}}}, timeout=120)
    assert r.status_code == 200, r.text
    probabilities = r.json()["answers"]["q"]["probabilities"]
    assert list(probabilities) == list(options)
    assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("compression", ["zstd", False])
def test_official_sdk_parses_noul_choice_and_score(cpu_stack: Stack, compression) -> None:
    from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

    long_state = TICKET + " Previous messages: " + " ".join(f"message {i} about the invoice." for i in range(60))
    assert len(long_state.encode()) > 1024  # the SDK compresses bodies of 1 KiB or more
    questions = {
        "refund": Noul(instructions=QUESTIONS["refund"]["instructions"]),
        "team": Choice(instructions="Which team?", criteria=QUESTIONS["team"]["criteria"]),
        "anger": Score(instructions="How frustrated?", criteria=QUESTIONS["anger"]["criteria"]),
    }
    with TypeSafeClient(api_key="unused", base_url=cpu_stack.url, timeout=120, compression=compression) as client:
        result = client.system_one(state=long_state, questions=questions, model="jev-latest")
    assert 0.0 <= result.nouls["refund"].noul <= 1.0
    assert result.choices["team"].choice in QUESTIONS["team"]["criteria"]
    assert 0.0 <= result.scores["anger"].score <= 2.0


def jevcompat(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cli = os.path.join(os.path.dirname(sys.executable), "jevcompat")
    return subprocess.run([cli, "test", url, "--timeout", "120", *args],
                          capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})


def test_jevcompat_passes_every_must_and_should_with_auth_off(cpu_stack: Stack, tmp_path) -> None:
    report = tmp_path / "report.json"
    run = jevcompat(cpu_stack.url, "--json", str(report))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_jevcompat_passes_with_auth_on(cpu_stack: Stack, tmp_path) -> None:
    api = start_api(cpu_stack.log_dir, {**cpu_stack.env, "OPENJEV_API_KEY": "jevcompat-key-123"})
    try:
        run = jevcompat(api.url or "", "--key-env", "OPENJEV_TEST_KEY", env={"OPENJEV_TEST_KEY": "jevcompat-key-123"})
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    finally:
        api.stop()
