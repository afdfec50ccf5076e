"""From label log-probabilities to answers: a stable softmax over the offered labels, rotations of a
debiased question averaged per option, a grouped question's two rounds combined, the fitted temperature
(and a noul's fitted prior), then the contract's numbers (noul, argmax choice, expected score) and
confidence."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.calibration import apply_temperature
from common.contract import ChoiceAnswer, NoulAnswer, ScoreAnswer
from common.jobs import Branch, FinalRound
from common.settings import ConfidenceMode


@dataclass(frozen=True)
class LabelDistribution:
    """Probabilities renormalised over exactly the offered labels, plus how much mass they had."""

    probabilities: list[float]
    label_mass: float  # sum of exp(logprob) over the labels before renormalising, in [0, 1]


def label_distribution(logprobs: list[float], temperature: float = 1.0) -> LabelDistribution:
    """Renormalise full-vocabulary label logprobs with a stable softmax at `temperature`."""
    if not logprobs:
        raise ValueError("no label logprobs")
    finite = [lp if math.isfinite(lp) else -math.inf for lp in logprobs]
    top = max(finite)
    if top == -math.inf:  # every label impossible: nothing to prefer, say so evenly
        n = len(finite)
        return LabelDistribution([1.0 / n] * n, 0.0)
    weights = [math.exp((lp - top) / temperature) for lp in finite]
    total = math.fsum(weights)
    mass = min(1.0, math.fsum(math.exp(lp) for lp in finite))
    return LabelDistribution([w / total for w in weights], mass)


def choice_confidence(probabilities: list[float]) -> float:
    """Official: (m − 1/n) / (1 − 1/n) for top probability m over n options; 1.0 when n = 1."""
    n = len(probabilities)
    if n == 1:
        return 1.0
    m = max(probabilities)
    return _unit((m - 1.0 / n) / (1.0 - 1.0 / n))


def score_confidence(probabilities: list[float]) -> float:
    """Official: max(0, 1 − Σ pᵢ·|i − k| / D), k the mode, D = (1/n)·Σᵢ |i − (n−1)/2|."""
    n = len(probabilities)
    k = max(range(n), key=probabilities.__getitem__)
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    if spread == 0:
        return 1.0
    distance = sum(p * abs(i - k) for i, p in enumerate(probabilities))
    return _unit(1.0 - distance / spread)


def entropy_confidence(probabilities: list[float]) -> float:
    """clamp(1 − H(p)/ln n, 0, 1): 1 when certain, 0 when uniform."""
    n = len(probabilities)
    if n < 2:
        return 1.0
    entropy = -math.fsum(p * math.log(p) for p in probabilities if p > 0)
    return _unit(1.0 - entropy / math.log(n))


def noul_answer(dist: LabelDistribution) -> NoulAnswer:
    """P(true); the true label is offered first."""
    return NoulAnswer(noul=_unit(dist.probabilities[0]), x_label_mass=dist.label_mass)


def choice_answer(dist: LabelDistribution, options: list[str], mode: ConfidenceMode) -> ChoiceAnswer:
    """The argmax option (first wins a tie), the distribution keyed by option name, and confidence."""
    probs = dist.probabilities
    best = max(range(len(probs)), key=probs.__getitem__)
    confidence = choice_confidence(probs) if mode is ConfidenceMode.typesafe else entropy_confidence(probs)
    return ChoiceAnswer(choice=options[best], probabilities=dict(zip(options, probs, strict=True)),
                        confidence=confidence, x_label_mass=dist.label_mass)


def score_answer(dist: LabelDistribution, legend: list[Any], mode: ConfidenceMode) -> ScoreAnswer:
    """The expected level Σ i·pᵢ, the legend echoed unchanged, the distribution and confidence."""
    probs = dist.probabilities
    confidence = score_confidence(probs) if mode is ConfidenceMode.typesafe else entropy_confidence(probs)
    return ScoreAnswer(score=min(float(len(probs) - 1), max(0.0, math.fsum(i * p for i, p in enumerate(probs)))),
                       legend={str(i): level for i, level in enumerate(legend)},
                       probabilities={str(i): p for i, p in enumerate(probs)},
                       confidence=confidence, x_label_mass=dist.label_mass)


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def question_answers(branches: Sequence[Branch], label_logprobs: Sequence[list[float]], temperature: float,
                     mode: ConfidenceMode) -> dict[str, NoulAnswer | ChoiceAnswer | ScoreAnswer]:
    """Answers keyed by question id, from each branch's label logprobs; a question's rotation branches
    (label-order debiasing) are averaged per option, a grouped question's rounds are combined
    (`grouped_distribution`), then its fitted temperature (and prior) is applied."""
    return {qid: _answer(group, mode) for qid, group in _by_question(branches, label_logprobs, temperature).items()}


def final_round_branches(branches: Sequence[Branch], label_logprobs: Sequence[list[float]], temperature: float,
                         final_rounds: dict[str, FinalRound]) -> list[Branch]:
    """The second round of each grouped question, from its first round's answers: each group's most likely
    option, listed in group order under the final round's labels."""
    finals = []
    for qid, group in _by_question(branches, label_logprobs, temperature).items():
        final = final_rounds.get(qid)
        if final is None:
            continue
        first = group[0][0]
        winners = []
        for rotations in _groups(group).values():
            within = option_distribution(rotations, len(first.option_names)).probabilities
            winners.append(max(rotations[0][0], key=within.__getitem__))  # type: ignore[arg-type]
        finals.append(first.model_copy(update={
            "suffix_ids": final.suffix_ids(winners), "label_ids": final.label_ids,
            "option_order": winners, "group": None}))
    return finals


def grouped_distribution(group: Sequence[tuple[Branch, LabelDistribution]]) -> LabelDistribution:
    """A grouped question's options: p(option) = the final round's p(its group's winner) × p(option | its
    group). The final round is the question's branch with no group; the label mass reported is its own."""
    size = len(group[0][0].option_names)
    groups = _groups(group)
    final = option_distribution(groups.pop(None), size)
    probabilities = [0.0] * size
    for rotations in groups.values():
        within = option_distribution(rotations, size).probabilities
        shown = rotations[0][0] or []
        reached = math.fsum(final.probabilities[i] for i in shown)  # the final round's mass on the group's winner
        for i in shown:
            probabilities[i] = reached * within[i]
    return LabelDistribution(probabilities, final.label_mass)


def option_distribution(rotations: Sequence[tuple[list[int] | None, LabelDistribution]],
                        size: int | None = None) -> LabelDistribution:
    """Each rotation's label probabilities mapped back to the options it showed, averaged over rotations.

    `size`: the question's option count, where the branches show only some of its options (zeros elsewhere).
    """
    totals = [0.0] * (size or len(rotations[0][1].probabilities))
    for order, dist in rotations:
        for label, p in enumerate(dist.probabilities):
            totals[label if order is None else order[label]] += p
    k = len(rotations)
    return LabelDistribution([t / k for t in totals], math.fsum(d.label_mass for _, d in rotations) / k)


def _by_question(branches: Sequence[Branch], label_logprobs: Sequence[list[float]], temperature: float
                 ) -> dict[str, list[tuple[Branch, LabelDistribution]]]:
    grouped: dict[str, list[tuple[Branch, LabelDistribution]]] = {}
    for branch, logprobs in zip(branches, label_logprobs, strict=True):
        grouped.setdefault(branch.question_id, []).append((branch, label_distribution(logprobs, temperature)))
    return grouped


def _groups(group: Sequence[tuple[Branch, LabelDistribution]]
            ) -> dict[int | None, list[tuple[list[int] | None, LabelDistribution]]]:
    rotations: dict[int | None, list[tuple[list[int] | None, LabelDistribution]]] = {}
    for branch, dist in group:
        rotations.setdefault(branch.group, []).append((branch.option_order, dist))
    return rotations


def _answer(group: list[tuple[Branch, LabelDistribution]], mode: ConfidenceMode
            ) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    branch = group[0][0]
    if any(b.group is not None for b, _ in group):
        dist = grouped_distribution(group)
    else:
        dist = option_distribution([(b.option_order, d) for b, d in group])
    calibrated = apply_temperature(dist.probabilities, branch.calibrated_temperature, branch.calibrated_log_odds_offset)
    dist = LabelDistribution(calibrated, dist.label_mass)
    if branch.kind == "noul":
        return noul_answer(dist)
    if branch.kind == "choice":
        return choice_answer(dist, branch.option_names, mode)
    return score_answer(dist, branch.legend or [], mode)
