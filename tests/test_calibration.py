"""Fitted temperatures and the noul label prior: fitting recovers a known temperature (and a known
log-odds offset), per type and per question asked often, `openjev calibrate` writes the file, and the
server applies it to every answer."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.calibration import (
    Calibration,
    CalibrationError,
    LabelledAnswer,
    apply_temperature,
    fit_calibration,
    fit_prior,
    fit_temperature,
    question_key,
)
from harness.processes import start_api
from harness.stacks import Stack
from harness.web import web


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def synthetic_answers(true_temperature: float, n: int, options: int, seed: int, kind: str = "choice"
                      ) -> list[LabelledAnswer]:
    """Answers whose reported distribution is softmax(z) while the truth is drawn from softmax(z / T)."""
    rng = random.Random(seed)
    answers = []
    for _ in range(n):
        logits = [rng.gauss(0.0, 3.0) for _ in range(options)]
        truth = softmax([z / true_temperature for z in logits])
        gold = rng.choices(range(options), weights=truth)[0]
        answers.append(LabelledAnswer(kind, softmax(logits), gold))
    return answers


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def synthetic_noul(true_temperature: float, true_offset: float, n: int, seed: int,
                   question: dict | None = None) -> list[LabelledAnswer]:
    """noul answers reporting σ(z) while "true" is drawn with probability σ(z / T + b). `question`: the
    question they answer; "each": a question of its own for every answer (asked once each)."""
    rng = random.Random(seed)
    answers = []
    for i in range(n):
        z = rng.gauss(0.5, 2.5)
        gold = 0 if rng.random() < sigmoid(z / true_temperature + true_offset) else 1
        asked = {"type": "noul", "instructions": f"Question {seed}-{i}?"} if question == "each" else question
        answers.append(LabelledAnswer("noul", [sigmoid(z), 1 - sigmoid(z)], gold, asked))
    return answers


@pytest.mark.parametrize("true_temperature", [0.5, 2.5])
def test_fitting_recovers_a_known_temperature_on_synthetic_logprobs(true_temperature: float) -> None:
    fitted = fit_temperature(synthetic_answers(true_temperature, 6000, 4, seed=7))
    assert fitted == pytest.approx(true_temperature, rel=0.08)


def test_each_question_type_gets_its_own_temperature() -> None:
    answers = synthetic_answers(3.0, 4000, 2, seed=1, kind="noul") + synthetic_answers(0.7, 4000, 5, seed=2)
    calibration = fit_calibration(answers)
    assert calibration.temperature("noul", 2) == pytest.approx(3.0, rel=0.1)
    assert calibration.temperature("choice", 5) == pytest.approx(0.7, rel=0.1)
    assert calibration.temperature("score", 3) == 1.0  # not fitted: unchanged


def test_option_count_buckets_are_fitted_only_with_enough_answers() -> None:
    answers = synthetic_answers(2.0, 3000, 4, seed=3) + synthetic_answers(0.5, 3000, 5, seed=4)
    answers += synthetic_answers(9.0, 10, 3, seed=5)
    fitted = fit_calibration(answers, by_options=True, min_bucket=30).temperatures["choice"]
    assert fitted.by_options[4] == pytest.approx(2.0, rel=0.1)
    assert fitted.by_options[5] == pytest.approx(0.5, rel=0.1)
    assert 3 not in fitted.by_options


@pytest.mark.parametrize(("true_temperature", "true_offset"), [(1.6, -0.8), (0.6, 0.5), (1.0, 0.0)])
def test_the_prior_fit_recovers_a_known_temperature_and_log_odds_offset(true_temperature: float,
                                                                        true_offset: float) -> None:
    temperature, offset = fit_prior(synthetic_noul(true_temperature, true_offset, 8000, seed=11))
    assert temperature == pytest.approx(true_temperature, rel=0.08)
    assert offset == pytest.approx(true_offset, abs=0.08)


def test_the_prior_fit_lowers_the_likelihood_below_a_temperature_alone() -> None:
    answers = synthetic_noul(1.0, -1.2, 3000, seed=12)  # says yes far too often, with the right sharpness

    def nll(temperature: float, offset: float) -> float:
        return -sum(math.log(apply_temperature(a.probabilities, temperature, offset)[a.gold]) for a in answers)

    temperature, offset = fit_prior(answers)
    alone = fit_temperature(answers)
    assert nll(temperature, offset) < nll(alone, 0.0) - 0.02 * len(answers)


def test_a_prior_is_fitted_for_noul_only_and_only_when_asked() -> None:
    answers = synthetic_noul(1.5, -0.7, 4000, seed=13) + synthetic_answers(0.7, 3000, 4, seed=14)
    with_prior = fit_calibration(answers, prior=True)
    assert with_prior.log_odds_offset("noul") == pytest.approx(-0.7, abs=0.1)
    assert with_prior.temperature("noul", 2) == pytest.approx(1.5, rel=0.1)
    assert with_prior.log_odds_offset("choice") == 0.0
    assert with_prior.temperature("choice", 4) == pytest.approx(0.7, rel=0.1)
    without = fit_calibration(answers)
    assert without.log_odds_offset("noul") == 0.0
    # a file that gives choice an offset is read, and the offset ignored: choice has debiasing instead
    loaded = Calibration.model_validate({"temperatures": {"choice": {"temperature": 1.0, "log_odds_offset": 2.0}}})
    assert loaded.log_odds_offset("choice") == 0.0


def test_a_question_key_ignores_option_order_and_foreign_fields_but_not_the_wording_or_level_order() -> None:
    team = {"type": "choice", "instructions": "Which team?", "criteria": {"Billing": None, "Sales": "deals"}}
    key = question_key(team)
    assert question_key({**team, "criteria": {"Sales": "deals", "Billing": None}}) == key  # rotated or reordered
    assert question_key({**team, "x_trace_id": "abc"}) == key  # fields the contract ignores
    assert question_key({**team, "instructions": "Which team now?"}) != key
    assert question_key({**team, "criteria": {"Billing": None, "Sales": "other deals"}}) != key
    urgency = {"type": "score", "criteria": ["Low", "High"]}
    assert question_key(urgency) != question_key({**urgency, "criteria": ["High", "Low"]})  # levels are ordered
    with pytest.raises(ValueError, match="type"):
        question_key({"instructions": "no type"})


def test_a_question_asked_often_gets_its_own_fit_and_the_type_fit_serves_the_others() -> None:
    sentiment = {"type": "noul", "instructions": "Is this review positive?"}
    # the repeated question is under-confident and says yes too often; one-off questions are over-confident
    often = synthetic_noul(0.5, -1.2, 4000, seed=21, question=sentiment)
    once = synthetic_noul(2.5, 0.0, 4000, seed=22, question="each")
    rare = synthetic_noul(9.0, 2.0, 10, seed=23, question={"type": "noul", "instructions": "Rare?"})
    calibration = fit_calibration(often + once + rare, prior=True, per_question=True)
    key = question_key(sentiment)
    assert set(calibration.questions) == {key}  # "Rare?" has 10 answers: under the 30 a fit needs
    assert calibration.questions[key].samples == 4000
    assert calibration.questions[key].question == {"type": "noul", "instructions": "Is this review positive?",
                                                   "criteria": None}
    assert calibration.temperature("noul", 2, key) == pytest.approx(0.5, rel=0.1)
    assert calibration.log_odds_offset("noul", key) == pytest.approx(-1.2, abs=0.1)
    # questions without their own entry (or no key at all) get the type's fit, made on the answers to them
    for other in (question_key({"type": "noul", "instructions": "Never seen?"}), None):
        assert calibration.temperature("noul", 2, other) == pytest.approx(2.5, rel=0.12)
        assert calibration.log_odds_offset("noul", other) == pytest.approx(0.0, abs=0.15)
    assert calibration.temperatures["noul"].samples == 4010
    # without per_question the one type fit lies between the two, right for neither
    pooled = fit_calibration(often + once + rare, prior=True)
    assert pooled.questions == {}
    assert 0.6 < pooled.temperature("noul", 2, key) < 2.2


def test_a_type_whose_every_question_has_its_own_fit_keeps_a_type_fit_on_all_its_answers() -> None:
    only = synthetic_noul(2.0, 0.0, 3000, seed=24, question={"type": "noul", "instructions": "Only?"})
    calibration = fit_calibration(only, per_question=True)
    assert calibration.temperature("noul", 2) == pytest.approx(2.0, rel=0.1)
    assert calibration.temperature("noul", 2) == calibration.temperature("noul", 2, question_key(only[0].question))


def test_applying_a_prior_adds_it_to_the_log_odds_of_the_first_option() -> None:
    p = 0.8
    got = apply_temperature([p, 1 - p], 2.0, -0.5)
    assert got[0] == pytest.approx(sigmoid(math.log(p / (1 - p)) / 2.0 - 0.5))
    assert sum(got) == pytest.approx(1.0)
    assert apply_temperature([1.0, 0.0], 1.0, -3.0) == [1.0, 0.0]  # a certain answer stays certain
    assert apply_temperature([0.0, 1.0], 1.0, 3.0) == [0.0, 1.0]


def test_applying_a_temperature_is_the_softmax_of_the_logprobs_at_that_temperature() -> None:
    logprobs = [-0.2, -1.9, -4.0]
    p = softmax(logprobs)
    assert apply_temperature(p, 2.0) == pytest.approx(softmax([x / 2.0 for x in logprobs]))
    assert apply_temperature(p, 1.0) == p
    assert apply_temperature([1.0, 0.0], 3.0) == [1.0, 0.0]


def test_an_unreadable_calibration_file_is_refused_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "calibration.json"
    bad.write_text('{"temperatures": {"noul": {"temperature": -1}}}')
    with pytest.raises(CalibrationError, match=r"calibration\.json"):
        Calibration.load(bad)
    with pytest.raises(CalibrationError, match=r"missing\.json"):
        Calibration.load(tmp_path / "missing.json")


def test_calibrate_command_fits_the_fit_split_and_writes_the_file(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    lines = [{"kind": a.kind, "probabilities": list(a.probabilities), "gold": a.gold, "split": "fit"}
             for a in synthetic_answers(2.0, 3000, 3, seed=9)]
    # Held-out answers would pull the fit towards 0.3 if they were used.
    lines += [{"kind": a.kind, "probabilities": list(a.probabilities), "gold": a.gold, "split": "held_out"}
              for a in synthetic_answers(0.3, 3000, 3, seed=10)]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "openjev", "calibrate", str(records), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Calibration.load(out).temperature("choice", 3) == pytest.approx(2.0, rel=0.1)
    assert "choice: T = " in done.stdout


def test_calibrate_command_fits_the_prior_when_asked(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"kind": a.kind, "probabilities": list(a.probabilities), "gold": a.gold,
                                           "split": "fit"}) + "\n" for a in synthetic_noul(1.3, 0.9, 4000, seed=15)))
    out = tmp_path / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "openjev", "calibrate", str(records), "-o", str(out), "--prior"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calibration = Calibration.load(out)
    assert calibration.log_odds_offset("noul") == pytest.approx(0.9, abs=0.1)
    assert calibration.temperature("noul", 2) == pytest.approx(1.3, rel=0.1)
    assert f"log-odds offset {calibration.log_odds_offset('noul'):+g}" in done.stdout


def test_calibrate_command_fits_a_repeated_question_on_its_own_when_asked(tmp_path: Path) -> None:
    sentiment = {"type": "noul", "instructions": "Is this review positive?"}
    answers = synthetic_noul(0.4, 0.0, 2000, seed=16, question=sentiment)
    answers += synthetic_noul(3.0, 0.0, 2000, seed=17, question="each")
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"kind": a.kind, "probabilities": list(a.probabilities), "gold": a.gold,
                                           "question": a.question}) + "\n" for a in answers))
    out = tmp_path / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "openjev", "calibrate", str(records), "-o", str(out),
                           "--per-question"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calibration = Calibration.load(out)
    assert calibration.temperature("noul", 2, question_key(sentiment)) == pytest.approx(0.4, rel=0.1)
    assert calibration.temperature("noul", 2) == pytest.approx(3.0, rel=0.12)
    assert f"question {question_key(sentiment)} (noul, 'Is this review positive?')" in done.stdout
    assert "(2000 answers)" in done.stdout


def test_calibrate_command_names_a_line_whose_question_is_not_one(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text('{"kind": "noul", "probabilities": [0.6, 0.4], "gold": 0, "question": {"type": "yes"}}\n')
    done = subprocess.run([sys.executable, "-m", "openjev", "calibrate", str(records), "-o", str(tmp_path / "c.json"),
                           "--per-question"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "records.jsonl:1" in done.stderr


def test_calibrate_command_names_the_bad_line(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text('{"kind": "noul", "probabilities": [0.6, 0.4], "gold": 0}\n{"kind": "noul"}\n')
    done = subprocess.run([sys.executable, "-m", "openjev", "calibrate", str(records), "-o", str(tmp_path / "c.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "records.jsonl:2" in done.stderr


@pytest.mark.integration
def test_the_server_applies_the_calibration_file_to_its_answers(cpu_stack: Stack, tmp_path: Path) -> None:
    body = {"model": "jev-latest", "state": "I was charged twice for my March invoice.",
            "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                          "angry": {"type": "noul", "instructions": "Is the customer angry?"},
                          "team": {"type": "choice", "criteria": {"Billing": None, "Technical": None, "Sales": None}}}}
    path = tmp_path / "calibration.json"
    own = {"question": body["questions"]["angry"], "temperature": 0.5, "log_odds_offset": 0.3}  # its own fit
    path.write_text(json.dumps({"temperatures": {"noul": {"temperature": 2.0, "log_odds_offset": -0.6},
                                                 "choice": {"temperature": 0.5}},
                                "questions": {question_key(body["questions"]["angry"]): own}}))
    calibrated_api = start_api(cpu_stack.log_dir, {**cpu_stack.env, "OPENJEV_CALIBRATION": str(path)})
    try:
        plain = cpu_stack.post(body, timeout=120).json()["answers"]
        assert calibrated_api.url
        calibrated = web.post(calibrated_api.url + "/v1/systemone", json=body, timeout=120).json()["answers"]
    finally:
        calibrated_api.stop()
    p = plain["refund"]["noul"]
    assert calibrated["refund"]["noul"] == pytest.approx(sigmoid(math.log(p / (1 - p)) / 2.0 - 0.6), abs=1e-4)
    p = plain["angry"]["noul"]
    assert calibrated["angry"]["noul"] == pytest.approx(sigmoid(math.log(p / (1 - p)) / 0.5 + 0.3), abs=1e-4)
    names = list(body["questions"]["team"]["criteria"])
    expected = apply_temperature([plain["team"]["probabilities"][n] for n in names], 0.5)
    assert [calibrated["team"]["probabilities"][n] for n in names] == pytest.approx(expected, abs=1e-4)
