"""Fitted temperatures: one per question type (and optionally per option count), fitted on labelled
answers by minimising the negative log-likelihood, stored as JSON and applied to each answer's
distribution as the last step of the softmax. Optionally (`--prior`) a noul question also gets a label
prior: an offset added to the log-odds of "true", fitted jointly with its temperature (Platt scaling),
for a model that says yes more (or less) often than the truth is yes.

A client that asks the same question of many states (the same type, instructions and options, each
time) can also have that question calibrated on its own (`--per-question`): one model is over-confident
on one question and under-confident on another of the same type, which no temperature per type can
mend. Such a question is found by `question_key`, a digest of the question as sent (option order aside);
questions without their own entry get the per-type temperatures, fitted on the answers to them.

Applying temperature T to a distribution p gives softmax(log p / T); with a prior b on the first option,
softmax(log p / T + [b, 0, …]), which for a noul answer is σ(logit(p) / T + b). For an answer read from
one branch that is exactly the softmax of the label logprobs at T; for a debiased answer (an average over
rotations) it rescales the average, which is what the fit saw, so fitting and serving agree. Choice and
score questions get no prior: their label-order bias is what debiasing (`x_debias`) removes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from common.contract import ChoiceQuestion, NoulQuestion, Question, ScoreQuestion

CALIBRATION_VERSION = 1
_LOG_T_RANGE = (math.log(0.02), math.log(50.0))  # temperatures searched; beyond them the data says "sharpen/flatten"
_MAX_LOG_ODDS = 50.0  # a noul answer's log-odds are clipped here for the prior's fit (p of 1 or 0 exactly)


class CalibrationError(ValueError):
    """A calibration file is missing, unreadable or not a calibration."""


class TypeTemperatures(BaseModel):
    """The temperature of one question type, with optional overrides by option count."""

    temperature: float = Field(gt=0)
    by_options: dict[int, float] = Field(default_factory=dict)  # option count → temperature
    # noul only: added to the log-odds of "true" after the temperature (a label prior; 0: none)
    log_odds_offset: float = Field(default=0.0, ge=-_MAX_LOG_ODDS, le=_MAX_LOG_ODDS)
    samples: int = 0  # labelled answers it was fitted on


class QuestionTemperature(BaseModel):
    """The temperature (and, for a noul question, the label prior) of one question asked many times."""

    question: dict[str, Any]  # the question as fitted, for people reading the file (lookup is by its key)
    temperature: float = Field(gt=0)
    log_odds_offset: float = Field(default=0.0, ge=-_MAX_LOG_ODDS, le=_MAX_LOG_ODDS)
    samples: int = 0


class Calibration(BaseModel):
    """The file `openjev calibrate` writes and `OPENJEV_CALIBRATION` points at."""

    version: int = CALIBRATION_VERSION
    temperatures: dict[str, TypeTemperatures] = Field(default_factory=dict)  # "noul" | "choice" | "score"
    questions: dict[str, QuestionTemperature] = Field(default_factory=dict)  # question_key → its own fit

    def temperature(self, kind: str, options: int, question: str | None = None) -> float:
        """The temperature for a question of `kind` with `options` options: the question's own (by its
        `question_key`) where fitted, else its type's (1.0 when not fitted)."""
        own = self.questions.get(question) if question is not None else None
        if own is not None:
            return own.temperature
        fitted = self.temperatures.get(kind)
        if fitted is None:
            return 1.0
        return fitted.by_options.get(options, fitted.temperature)

    def log_odds_offset(self, kind: str, question: str | None = None) -> float:
        """The prior added to a noul answer's log-odds of "true" (0.0 for other types, or when not fitted)."""
        if kind != "noul":
            return 0.0
        own = self.questions.get(question) if question is not None else None
        if own is not None:
            return own.log_odds_offset
        fitted = self.temperatures.get(kind)
        return fitted.log_odds_offset if fitted is not None else 0.0

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read a calibration file; CalibrationError says why one cannot be used."""
        try:
            return cls.model_validate_json(Path(path).read_bytes())
        except (OSError, ValueError) as error:
            raise CalibrationError(f"calibration file {path}: {error}") from None


_QUESTION = TypeAdapter(Question)


def question_key(question: NoulQuestion | ChoiceQuestion | ScoreQuestion | Mapping[str, Any]) -> str:
    """A digest of a question as a client sends it: its type, instructions and criteria, as the contract
    reads them (fields it ignores are left out), with choice options in any order (debiasing and clients
    may reorder them). A dict is validated first; ValueError says why it is not a question."""
    return _question_key(_as_read(question))


def _as_read(question: NoulQuestion | ChoiceQuestion | ScoreQuestion | Mapping[str, Any]) -> dict[str, Any]:
    """The question as the contract reads it, as JSON."""
    if isinstance(question, Mapping):
        question = _QUESTION.validate_python(question)
    return question.model_dump(mode="json")


def _question_key(read: dict[str, Any]) -> str:
    text = json.dumps(read, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class LabelledAnswer:
    """One answer's distribution (over its options, at temperature 1) and the index of the right option;
    with the question it answers (as sent) where known, for `fit_calibration(per_question=True)`."""

    kind: str
    probabilities: Sequence[float]
    gold: int
    question: Mapping[str, Any] | None = None


ANSWER_LINE = '{"kind": "choice", "probabilities": [0.7, 0.2, 0.1], "gold": 0}'
"""One line of `openjev calibrate`'s input (`openjev calibrate --help` explains each field; a file of them:
examples/calibration-records.jsonl)."""


def read_labelled_answers(path: Path) -> list[LabelledAnswer]:
    """The answers to fit on in a JSONL file (`ANSWER_LINE`), held-out lines skipped; CalibrationError names
    the file, and the line and what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CalibrationError(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    answers = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            answer = labelled_answer(json.loads(line))
        except json.JSONDecodeError as error:
            raise CalibrationError(f"{path}:{number}: not a JSON object ({error.msg}, column {error.colno})") from None
        except ValidationError as error:
            first = error.errors()[0]
            where = "".join(f".{step}" for step in first["loc"])
            raise CalibrationError(f'{path}:{number}: "question{where}" is not a question: {first["msg"]}') from None
        except ValueError as error:
            raise CalibrationError(f"{path}:{number}: {error}") from None
        if answer is not None:
            answers.append(answer)
    return answers


def labelled_answer(record: Any) -> LabelledAnswer | None:
    """One line of the input read; None for a held-out line. ValueError says what is wrong, in words."""
    if not isinstance(record, dict):
        raise ValueError(f"expected an object like {ANSWER_LINE}")
    kind = record.get("kind")
    if kind not in ("noul", "choice", "score"):
        raise ValueError(f'"kind" must be "noul", "choice" or "score", not {json.dumps(kind)}')
    probabilities = record.get("probabilities")
    if not (isinstance(probabilities, list) and len(probabilities) >= 2 and all(
            isinstance(p, int | float) and not isinstance(p, bool) and 0 <= p <= 1 for p in probabilities)):
        raise ValueError('"probabilities" must be a list of numbers in [0, 1], one per option in the order asked '
                         f"(noul: [P(true), P(false)]), not {json.dumps(probabilities)[:80]}")
    gold = record.get("gold")
    if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(probabilities)):
        raise ValueError(f'"gold" must be the index of the right option in "probabilities" (0 to '
                         f"{len(probabilities) - 1}; noul: 0 for true), not {json.dumps(gold)}")
    question = record.get("question")
    if question is not None:
        question_key(question)  # refuses what is not a question
    if record.get("split") == "held_out":
        return None
    return LabelledAnswer(kind, [float(p) for p in probabilities], gold, question)


def apply_temperature(probabilities: Sequence[float], temperature: float, first_offset: float = 0.0) -> list[float]:
    """softmax(log p / T + [first_offset, 0, …]); zeros stay zero, and T = 1 with no offset returns p unchanged."""
    if temperature == 1.0 and first_offset == 0.0:
        return list(probabilities)
    logs = [math.log(p) / temperature if p > 0 else -math.inf for p in probabilities]
    if first_offset and logs[0] != -math.inf:
        logs[0] += first_offset
    top = max(logs)
    weights = [math.exp(lp - top) for lp in logs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def negative_log_likelihood(answers: Iterable[LabelledAnswer], temperature: float) -> float:
    """Mean −log p(gold) after applying `temperature`."""
    losses = [-math.log(max(apply_temperature(a.probabilities, temperature)[a.gold], 1e-300)) for a in answers]
    return math.fsum(losses) / max(1, len(losses))


def fit_temperature(answers: Sequence[LabelledAnswer]) -> float:
    """The temperature minimising the NLL of `answers` (golden-section search on log T: NLL is unimodal there)."""
    if not answers:
        return 1.0
    low, high = _LOG_T_RANGE
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = (negative_log_likelihood(answers, math.exp(x)) for x in (a, b))
    for _ in range(60):  # the bracket shrinks by 0.618 per step: far below any useful precision
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = negative_log_likelihood(answers, math.exp(a))
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = negative_log_likelihood(answers, math.exp(b))
    return math.exp((low + high) / 2)


def fit_prior(answers: Sequence[LabelledAnswer]) -> tuple[float, float]:
    """The temperature T and log-odds offset b minimising the NLL of two-option `answers` under
    σ(logit(p) / T + b) (Platt scaling). The NLL is convex in (1/T, b): damped Newton steps from (1, 0).
    A fit that would not sharpen or flatten within the temperature range is held at its bound."""
    pairs = []
    for a in answers:
        p, q = a.probabilities
        logit = _clip((math.log(p) if p > 0 else -math.inf) - (math.log(q) if q > 0 else -math.inf))
        pairs.append((logit, 1.0 if a.gold == 0 else 0.0))
    if not pairs:
        return 1.0, 0.0
    low, high = 1 / math.exp(_LOG_T_RANGE[1]), 1 / math.exp(_LOG_T_RANGE[0])  # the range of 1/T
    scale, offset = 1.0, 0.0
    loss = _platt_loss(pairs, scale, offset)
    for _ in range(100):
        g_scale = g_offset = h_ss = h_so = h_oo = 0.0
        for z, y in pairs:
            s = _sigmoid(scale * z + offset)
            w = s * (1 - s)
            g_scale += (s - y) * z
            g_offset += s - y
            h_ss += w * z * z
            h_so += w * z
            h_oo += w
        det = h_ss * h_oo - h_so * h_so
        if det <= 1e-12 * max(1.0, h_ss * h_oo):  # flat (e.g. every logit alike): a gradient step instead
            step_scale, step_offset = g_scale / max(h_ss, 1e-9), g_offset / max(h_oo, 1e-9)
        else:
            step_scale = (h_oo * g_scale - h_so * g_offset) / det
            step_offset = (h_ss * g_offset - h_so * g_scale) / det
        for damping in (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125):
            new_scale = min(high, max(low, scale - damping * step_scale))
            new_offset = _clip(offset - damping * step_offset)
            new_loss = _platt_loss(pairs, new_scale, new_offset)
            if new_loss <= loss:
                break
        else:
            break  # no step lowers the loss: at the minimum (to float precision) or at a bound
        converged = loss - new_loss < 1e-12
        scale, offset, loss = new_scale, new_offset, new_loss
        if converged:
            break
    return 1 / scale, offset


def _platt_loss(pairs: Sequence[tuple[float, float]], scale: float, offset: float) -> float:
    total = 0.0
    for z, y in pairs:
        x = scale * z + offset  # −log σ(x) for y = 1, −log σ(−x) for y = 0, computed stably
        total += _softplus(-x) if y else _softplus(x)
    return total / len(pairs)


def _softplus(x: float) -> float:
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _clip(x: float) -> float:
    return max(-_MAX_LOG_ODDS, min(_MAX_LOG_ODDS, x))


def fit_calibration(answers: Sequence[LabelledAnswer], by_options: bool = False, min_bucket: int = 30,
                    prior: bool = False, per_question: bool = False) -> Calibration:
    """One temperature per question type; with `by_options`, also one per option count that has at least
    `min_bucket` answers (fewer would fit noise); with `prior`, noul answers get a log-odds offset fitted
    jointly with their temperature (`fit_prior`).

    With `per_question`, each question with at least `min_bucket` answers gets its own temperature (and
    prior, for noul with `prior`); the per-type temperatures are then fitted on the other answers, the
    ones they will serve (on all of a type's answers where every question of it has its own)."""
    questions: dict[str, QuestionTemperature] = {}
    rest = list(answers)
    if per_question:
        reads = [_as_read(a.question) if a.question is not None else None for a in answers]
        keys = [_question_key(read) if read is not None else None for read in reads]
        groups: dict[str, list[LabelledAnswer]] = {}
        read_of: dict[str, dict[str, Any]] = {}
        for a, key, read in zip(answers, keys, reads, strict=True):
            if key is not None and read is not None:
                groups.setdefault(key, []).append(a)
                read_of[key] = read
        for key, group in sorted(groups.items()):
            if len(group) < min_bucket:
                continue
            kind = group[0].kind
            temperature, offset = (fit_prior(group) if prior and kind == "noul" else (fit_temperature(group), 0.0))
            questions[key] = QuestionTemperature(question=read_of[key],
                                                 temperature=round(temperature, 4), log_odds_offset=round(offset, 4),
                                                 samples=len(group))
        rest = [a for a, key in zip(answers, keys, strict=True) if key not in questions]
    temperatures: dict[str, TypeTemperatures] = {}
    for kind in sorted({a.kind for a in answers}):
        of_kind = [a for a in rest if a.kind == kind] or [a for a in answers if a.kind == kind]
        if prior and kind == "noul":
            temperature, offset = fit_prior([a for a in of_kind if len(a.probabilities) == 2])
            temperatures[kind] = TypeTemperatures(temperature=round(temperature, 4), log_odds_offset=round(offset, 4),
                                                  samples=len(of_kind))
            continue
        buckets: dict[int, float] = {}
        if by_options:
            for count in sorted({len(a.probabilities) for a in of_kind}):
                bucket = [a for a in of_kind if len(a.probabilities) == count]
                if len(bucket) >= min_bucket:
                    buckets[count] = round(fit_temperature(bucket), 4)
        temperatures[kind] = TypeTemperatures(temperature=round(fit_temperature(of_kind), 4), by_options=buckets,
                                              samples=len(of_kind))
    return Calibration(temperatures=temperatures, questions=questions)
