"""Label-order debiasing: each choice/score question is asked under cyclic rotations of its options,
all after the one shared prefix, and the probabilities are averaged per option."""

from __future__ import annotations

import itertools

import pytest

from common.contract import SystemOneRequest
from common.jobs import Branch
from common.prompt import PromptCompiler, rotation_orders
from common.scoring import question_answers
from common.settings import ConfidenceMode
from common.tokenizer import smollm2_tokenizer
from harness.stacks import Stack

TEAMS = {"Billing": "Payments, invoices, refunds", "Technical": "Bugs, outages, integrations",
         "Sales": "Pricing, upgrades, new contracts", "Legal": "Contracts, privacy, compliance"}
STATE = "Hi, I was charged twice for my March invoice and I'd like the duplicate refunded."


def body(criteria: dict, debias: bool | None = True, **questions: dict) -> dict:
    request = {"model": "jev-latest", "state": STATE,
               "questions": {"team": {"type": "choice", "instructions": "Which team should handle this?",
                                      "criteria": criteria}, **questions}}
    if debias is not None:
        request["x_debias"] = debias
    return request


@pytest.fixture(scope="module")
def compiler() -> PromptCompiler:
    return PromptCompiler.for_tokenizer(smollm2_tokenizer())


def test_rotations_put_every_option_at_every_label_once() -> None:
    orders = rotation_orders(SystemOneRequest.model_validate(body(TEAMS)).questions["team"], 4)  # type: ignore[arg-type]
    assert len(orders) == 4
    for label in range(4):
        assert sorted(order[label] for order in orders) == [0, 1, 2, 3]


def test_a_rotation_cap_below_the_option_count_spreads_the_shifts() -> None:
    question = SystemOneRequest.model_validate(body({f"o{i}": None for i in range(10)})).questions["team"]
    orders = rotation_orders(question, 4)  # type: ignore[arg-type]
    assert [order[0] for order in orders] == [0, 2, 5, 7]


def test_debiased_questions_get_one_branch_per_rotation_after_the_same_prefix(compiler: PromptCompiler) -> None:
    request = SystemOneRequest.model_validate(body(
        TEAMS, refund={"type": "noul", "instructions": "Refund?"},
        urgency={"type": "score", "criteria": ["Low", "Medium", "High"]}))
    plain, debiased = compiler.compile(request), compiler.compile(request, max_rotations=8)
    assert plain.prefix_ids == debiased.prefix_ids
    assert [b.question_id for b in debiased.branches] == ["team"] * 4 + ["refund"] + ["urgency"] * 3
    assert len({tuple(b.suffix_ids) for b in debiased.branches}) == len(debiased.branches)
    assert [b.option_order for b in debiased.branches if b.question_id == "urgency"] == [[0, 1, 2], [1, 2, 0],
                                                                                         [2, 0, 1]]
    assert debiased.branches[4].option_order is None  # a noul question is asked once


def test_averaged_rotations_report_each_option_under_its_own_name() -> None:
    # Two rotations of options [x, y]: the model always prefers the first label at 0.9.
    branches = [Branch(question_id="q", kind="choice", suffix_ids=[], label_ids=[1, 2], option_names=["x", "y"],
                       option_order=order) for order in ([0, 1], [1, 0])]
    logprobs = [[-0.10536, -2.30259]] * 2  # ln 0.9, ln 0.1
    answer = question_answers(branches, logprobs, 1.0, ConfidenceMode.typesafe)["q"]
    assert answer.probabilities == pytest.approx({"x": 0.5, "y": 0.5}, abs=1e-4)


@pytest.mark.integration
def test_debiasing_makes_a_choice_answer_invariant_to_option_order(cpu_stack: Stack) -> None:
    orders = [dict(items) for items in itertools.islice(itertools.permutations(TEAMS.items()), 0, 24, 5)]
    debiased = [cpu_stack.post(body(criteria), timeout=180).json()["answers"]["team"] for criteria in orders]
    for answer in debiased[1:]:
        assert answer["choice"] == debiased[0]["choice"]
        assert answer["probabilities"] == pytest.approx(debiased[0]["probabilities"], abs=1e-5)
    # Without debiasing the small model's letter preference moves its answer with the order.
    plain = [cpu_stack.post(body(criteria, debias=False), timeout=180).json()["answers"]["team"]
             for criteria in orders]
    assert any(a["probabilities"] != pytest.approx(plain[0]["probabilities"], abs=1e-3) for a in plain[1:])


@pytest.mark.integration
def test_usage_counts_every_rotation_branch(cpu_stack: Stack) -> None:
    plain = cpu_stack.post(body(TEAMS, debias=False), timeout=180).json()["usage"]
    debiased = cpu_stack.post(body(TEAMS), timeout=180).json()
    assert debiased["usage"]["output_tokens"] == 1 + 4 == plain["output_tokens"] + 3
    assert debiased["usage"]["input_tokens"] > 3 * plain["input_tokens"]
    assert set(debiased["answers"]["team"]) == {"type", "choice", "probabilities", "confidence", "x_label_mass"}
