"""Grouped choice questions (OPENJEV_OPTION_GROUP_SIZE): a long option list is asked in groups, then the
groups' winners in a final round the worker assembles from token pieces. Each round must be exactly the
question a client would get by asking those options itself, and the answer the product of the rounds."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from api.preparation import JobPreparer
from common.contract import SystemOneRequest
from common.jobs import GROUPED_JOB_RECORD_VERSION, Branch, FinalRound
from common.prompt import PromptCompiler
from common.scoring import final_round_branches, grouped_distribution, label_distribution, question_answers
from common.settings import ConfidenceMode, Settings
from common.tokenizer import qwen36_tokenizer, smollm2_tokenizer
from harness.stacks import Stack, isolated_scripted_stack
from openjev.smoke import REFUND_STATE, many_options

INSTRUCTIONS = "Which team should handle this message?"


def ask(criteria: dict[str, Any], state: str = REFUND_STATE, **extra: Any) -> SystemOneRequest:
    question = {"type": "choice", "instructions": INSTRUCTIONS, "criteria": criteria}
    return SystemOneRequest.model_validate({"model": "jev-latest", "state": state, "questions": {"q": question},
                                            **extra})


def alone(compiler: PromptCompiler, criteria: dict[str, Any]) -> list[int]:
    """The suffix ids of the question asked with exactly these options, in this order, in one branch."""
    return compiler.compile(ask(criteria)).branches[0].suffix_ids


def odd_options(seed: int, count: int) -> dict[str, Any]:
    """Descriptions that test the joins: trailing spaces and newlines, punctuation, digits, JSON, unicode."""
    rnd = random.Random(seed)
    ends = ["", " ", ".", "!\n", "\n\n", "  ", ":", "3", "é", "…", ")", "\t"]
    options: dict[str, Any] = {}
    for i in range(count):
        roll = rnd.random()
        if roll < 0.2:
            about: Any = None
        elif roll < 0.3:
            about = {"team": f"t{i}", "tags": ["a", i]}
        else:
            about = f"{rnd.choice(['Refunds', 'bugs', '42 cases', 'Über', '- dash', 'x'])} {i}{rnd.choice(ends)}"
        options[f"{rnd.choice(['Team', 'desk', 'Équipe', '#'])} {i}"] = about
    return options


def test_groups_are_consecutive_balanced_and_each_asked_as_its_own_question(compiler: PromptCompiler) -> None:
    criteria = many_options(255)
    compiled = compiler.compile(ask(criteria), group_size=26)
    names = list(criteria)
    assert [b.group for b in compiled.branches] == list(range(10))  # ⌈255 / 26⌉ groups, one branch each
    members = [b.option_order for b in compiled.branches]
    assert [i for group in members for i in group or []] == list(range(255))
    assert {len(group or []) for group in members} == {25, 26}
    for branch in compiled.branches:
        shown = {names[i]: criteria[names[i]] for i in branch.option_order or []}
        assert branch.suffix_ids == alone(compiler, shown)
        assert branch.option_names == names


@pytest.mark.parametrize("seed", range(6))
def test_the_final_round_joins_its_pieces_into_the_winners_question(
        compiler: PromptCompiler, tokenizer_name: str, seed: int) -> None:
    criteria = odd_options(seed, 60) if seed else many_options(255)
    if tokenizer_name != "qwen36" and seed:
        # GPT-2's pre-tokenizer splits a whitespace run before a line's end differently when the next line
        # follows: such descriptions are asked in one branch (next test); the rest join.
        criteria = {name: about.rstrip() if isinstance(about, str) else about for name, about in criteria.items()}
    compiled = compiler.compile(ask(criteria), group_size=8)
    groups = [b.option_order or [] for b in compiled.branches]
    final = compiled.final_rounds.get("q")
    assert final is not None, "the pieces should join for this tokenizer"
    names = list(criteria)
    rnd = random.Random(seed)
    for _ in range(5):
        winners = [rnd.choice(group) for group in groups]
        assert final.suffix_ids(winners) == alone(compiler, {names[w]: criteria[names[w]] for w in winners})
        assert final.most_tokens >= len(final.suffix_ids(winners))


def test_a_repeated_question_has_its_final_round_cut_once(compiler: PromptCompiler) -> None:
    first = compiler.compile(ask(many_options(100)), group_size=26).final_rounds["q"]
    again = compiler.compile(ask(many_options(100), state="another state"), group_size=26).final_rounds["q"]
    assert again is first
    other = compiler.compile(ask({**many_options(99), "Extra": "One more"}), group_size=26).final_rounds["q"]
    assert other is not first and len(other.line_ids) == 100
    # The same question in groups of another size: a final round of another length, never the cached one.
    more = compiler.compile(ask(many_options(100)), group_size=10).final_rounds["q"]
    assert (first.groups, more.groups) == (4, 10) and len(more.label_ids) == 10


def test_a_question_whose_pieces_do_not_join_is_asked_in_one_branch() -> None:
    compiler = PromptCompiler.for_tokenizer(smollm2_tokenizer())
    criteria = {f"Team {i}": f"Handles case {i}\n\n" for i in range(12)}  # GPT-2 splits "\n\n" + "B" as "\n", "\n"
    grouped = compiler.compile(ask(criteria), group_size=4)
    assert grouped.final_rounds == {}
    assert grouped.branches == compiler.compile(ask(criteria)).branches


def test_questions_within_the_group_size_and_other_types_are_asked_in_one_branch(compiler: PromptCompiler) -> None:
    request = SystemOneRequest.model_validate({
        "model": "jev-latest", "state": "s", "questions": {
            "few": {"type": "choice", "criteria": many_options(26)},
            "score": {"type": "score", "criteria": [f"level {i}" for i in range(40)]},
            "noul": {"type": "noul"}}})
    compiled = compiler.compile(request, group_size=26)
    assert compiled.final_rounds == {}
    assert [b.group for b in compiled.branches] == [None, None, None]


def test_debiased_groups_hold_the_same_options_whatever_the_order_sent(compiler: PromptCompiler) -> None:
    criteria = many_options(40)
    shuffled = dict(random.Random(3).sample(sorted(criteria.items()), len(criteria)))
    compiled = [compiler.compile(ask(c), max_rotations=4, group_size=16) for c in (criteria, shuffled)]
    for one in compiled:
        assert [b.group for b in one.branches] == [0] * 4 + [1] * 4 + [2] * 4  # 3 groups × 4 rotations
    names = [list(criteria), list(shuffled)]
    shown = [sorted(tuple(names[k][i] for i in b.option_order or []) for b in one.branches)
             for k, one in enumerate(compiled)]
    assert shown[0] == shown[1]
    suffixes = [sorted(tuple(b.suffix_ids) for b in one.branches) for one in compiled]
    assert suffixes[0] == suffixes[1]


def test_grouped_probabilities_are_the_final_rounds_times_the_groups() -> None:
    final = FinalRound(groups=2, head_ids=[1], list_label_ids=[[2], [3]], line_ids=[[10], [11], [12], [13]],
                       tail_ids=[4], label_ids=[20, 21])
    first = [Branch(question_id="q", kind="choice", suffix_ids=[0], label_ids=[20, 21], option_names=list("wxyz"),
                    option_order=order, group=g) for g, order in enumerate(([0, 1], [3, 2]))]
    logs = [[math.log(0.8), math.log(0.2)], [math.log(0.7), math.log(0.3)]]  # group 1 shows z (0.7) then y (0.3)
    (last,) = final_round_branches(first, logs, 1.0, {"q": final})
    assert last.option_order == [0, 3]  # the winners, w and z, in group order
    assert last.suffix_ids == [1, 2, 10, 3, 13, 4]
    answer = question_answers([*first, last], [*logs, [math.log(0.6), math.log(0.4)]], 1.0,
                              ConfidenceMode.typesafe)["q"]
    # w 0.6·0.8, x 0.6·0.2, y 0.4·0.3, z 0.4·0.7
    assert answer.probabilities == pytest.approx({"w": 0.48, "x": 0.12, "y": 0.12, "z": 0.28})
    assert answer.choice == "w"
    dist = grouped_distribution([(b, label_distribution(lp)) for b, lp in
                                 zip([*first, last], [*logs, [math.log(0.6), math.log(0.4)]], strict=True)])
    assert math.fsum(dist.probabilities) == pytest.approx(1.0)


def test_a_group_size_of_one_is_refused() -> None:
    with pytest.raises(ValidationError, match="at least 2 options"):
        Settings(option_group_size=1)
    with pytest.raises(ValidationError, match="at least 2 options"):
        ask(many_options(3), x_option_group_size=1)
    with pytest.raises(ValidationError, match="at least 2 options"):
        ask(many_options(3), x_option_group_size=1.0)
    with pytest.raises(ValidationError, match="valid integer"):
        ask(many_options(3), x_option_group_size=2.5)
    with pytest.raises(ValidationError, match="valid integer"):
        ask(many_options(3), x_option_group_size="26")
    assert ask(many_options(3), x_option_group_size=26.0).x_option_group_size == 26  # JSON Schema's integer


def test_a_request_sets_its_own_group_size_over_the_servers(tmp_path: Path) -> None:
    preparer = JobPreparer(Settings(option_group_size=26, cache_dir=tmp_path),
                           PromptCompiler.for_tokenizer(qwen36_tokenizer()))
    assert len(preparer.prepare(ask(many_options(40), x_option_group_size=0), "r", 60).branches) == 1
    assert len(preparer.prepare(ask(many_options(40), x_option_group_size=10), "r", 60).branches) == 4
    assert len(preparer.prepare(ask(many_options(40)), "r", 60).branches) == 2


@pytest.mark.integration
def test_a_group_size_below_two_is_a_422_with_a_message(cpu_stack: Stack) -> None:
    response = cpu_stack.post({"model": "jev-latest", "state": "s", "x_option_group_size": 1,
                               "questions": {"q": {"type": "choice", "criteria": many_options(3)}}})
    assert response.status_code == 422
    assert "at least 2 options" in response.text


def test_the_job_carries_the_final_round_and_admission_charges_it(tmp_path: Path) -> None:
    compiler = PromptCompiler.for_tokenizer(qwen36_tokenizer())
    settings = Settings(option_group_size=26, cache_dir=tmp_path)
    job = JobPreparer(settings, compiler).prepare(ask(many_options(255)), "req_1", 60.0)
    assert job.version == GROUPED_JOB_RECORD_VERSION
    assert set(job.final_rounds) == {"q"} and len(job.branches) == 10
    final = job.final_rounds["q"]
    assert job.total_input_tokens == (len(job.prefix_ids) * 12 + sum(len(b.suffix_ids) for b in job.branches)
                                      + final.most_tokens)
    # A total limit the groups fit in but the final round does not: refused before any GPU work.
    tight = Settings(option_group_size=26, cache_dir=tmp_path, max_total_input_tokens=job.total_input_tokens - 1)
    with pytest.raises(Exception, match="final round for grouped options"):
        JobPreparer(tight, compiler).prepare(ask(many_options(255)), "req_2", 60.0)
    plain = JobPreparer(Settings(cache_dir=tmp_path), compiler).prepare(ask(many_options(255)), "req_3", 60.0)
    assert plain.version == 1 and plain.final_rounds == {} and len(plain.branches) == 1


@pytest.mark.integration
def test_a_grouped_answer_is_the_product_of_its_rounds_asked_alone(cpu_stack: Stack) -> None:
    criteria = {"Billing": "Payments, invoices, refunds and double charges", "Technical": "Bugs and outages",
                "Sales": "New plans and upgrades", "Legal": "Contracts and privacy", "Security": "Breaches",
                "Shipping": "Parcels and delivery", "Hiring": "Jobs and interviews", "Press": "Journalists",
                "Partners": "Resellers", "Facilities": "Offices and parking"}
    names = list(criteria)
    response = cpu_stack.post({"model": "jev-latest", "state": REFUND_STATE, "x_option_group_size": 4,
                               "questions": {"q": {"type": "choice", "instructions": INSTRUCTIONS,
                                                   "criteria": criteria}}}, timeout=180)
    assert response.status_code == 200, response.text
    body = response.json()
    answer = body["answers"]["q"]
    assert body["usage"]["output_tokens"] == 3 + 1 + 1  # three groups, the final round, the warm call
    assert list(answer["probabilities"]) == names
    assert math.fsum(answer["probabilities"].values()) == pytest.approx(1.0)

    # The same rounds asked by hand, one question per group, then the winners.
    groups = [names[0:3], names[3:6], names[6:10]]  # ⌊g·10/3⌋ boundaries
    questions = {f"g{g}": {"type": "choice", "instructions": INSTRUCTIONS,
                           "criteria": {name: criteria[name] for name in group}} for g, group in enumerate(groups)}
    within = cpu_stack.post({"model": "jev-latest", "state": REFUND_STATE, "questions": questions},
                            timeout=180).json()["answers"]
    winners = [max(group, key=within[f"g{g}"]["probabilities"].get) for g, group in enumerate(groups)]
    final = cpu_stack.post({"model": "jev-latest", "state": REFUND_STATE, "questions": {"f": {
        "type": "choice", "instructions": INSTRUCTIONS, "criteria": {w: criteria[w] for w in winners}}}},
        timeout=180).json()["answers"]["f"]["probabilities"]
    expected = {name: final[winners[g]] * within[f"g{g}"]["probabilities"][name]
                for g, group in enumerate(groups) for name in group}
    assert answer["probabilities"] == pytest.approx(expected, abs=2e-3)
    assert answer["choice"] == max(expected, key=expected.__getitem__)


TEN = {f"Team {i}": f"Handles case {i}" for i in range(10)}  # groups of 4: three groups (b0-b2), final b3


def grouped_body(criteria: dict[str, Any]) -> dict[str, Any]:
    return {"model": "jev-latest", "state": "I was charged twice.", "x_option_group_size": 4,
            "questions": {"q": {"type": "choice", "criteria": criteria}}}


@pytest.fixture(scope="module")
def scripted(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_REQUEST_TIMEOUT="4") as stack:
        yield stack


@pytest.mark.integration
def test_the_final_round_is_sent_after_the_groups_answer(scripted: Stack) -> None:
    scripted.script(delay=0.0, fail_rid_suffix=None, slow_rid_infix=None)
    before = len(scripted.engine_stats()["received"])
    response = scripted.post(grouped_body(TEN))
    assert response.status_code == 200, response.text
    stats = scripted.engine_stats()
    rids = [rid.rsplit(".", 1)[1] for rid in stats["received"][before:]]
    assert rids[0] == "warm" and sorted(rids[1:4]) == ["b0", "b1", "b2"] and rids[4:] == ["b3"]
    assert stats["finished"].index(stats["received"][before + 4]) > max(
        stats["finished"].index(rid) for rid in stats["received"][before + 1:before + 4])
    assert response.json()["usage"]["output_tokens"] == 5


@pytest.mark.integration
def test_a_failing_final_round_fails_the_request_with_an_engine_error(scripted: Stack) -> None:
    # a 400, the request's own fault, fails it at once (a 5xx would run it again: test_engine_failures.py)
    scripted.script(delay=0.0, fail_rid_suffix=".b3", fail_status=400, slow_rid_infix=None)
    response = scripted.post(grouped_body(TEN))
    assert response.status_code == 502, response.text
    assert response.json()["detail"]["error_type"] == "engine_error"


@pytest.mark.integration
def test_a_deadline_in_the_final_round_aborts_it_in_the_engine(scripted: Stack) -> None:
    scripted.script(delay=0.0, fail_rid_suffix=None, slow_rid_infix=".b3", slow_delay=60.0)
    started = time.monotonic()
    response = scripted.post(grouped_body(TEN), timeout=30)
    assert response.status_code == 504, response.text
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while not any(rid.endswith(".b3") for rid in scripted.engine_stats()["aborted"]):
        assert time.monotonic() < deadline, "the final round was never aborted"
        time.sleep(0.1)
    assert scripted.engine_stats()["live"] == []


@pytest.mark.integration
def test_a_debiased_grouped_answer_does_not_depend_on_the_order_sent(cpu_stack: Stack) -> None:
    criteria = {f"Team {name}": f"Handles {about}" for name, about in zip(
        "ABCDEFGHIJ", ["refunds", "bugs", "sales", "law", "breaches", "parcels", "jobs", "press", "resellers",
                       "offices"], strict=True)}
    orders = [criteria, dict(reversed(criteria.items())), dict(random.Random(5).sample(list(criteria.items()), 10))]
    answers = []
    for order in orders:
        body = grouped_body(order) | {"state": REFUND_STATE, "x_debias": True}
        response = cpu_stack.post(body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["output_tokens"] == 3 + 3 + 4 + 1 + 1  # rotated groups, final, warm
        answers.append(response.json()["answers"]["q"])
    for answer in answers[1:]:
        assert answer["choice"] == answers[0]["choice"]
        assert answer["probabilities"] == pytest.approx(answers[0]["probabilities"], abs=1e-5)
