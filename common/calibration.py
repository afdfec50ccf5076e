"""Fitted temperatures: one per question type (and optionally per option count), fitted on labelled
answers by minimising the negative log-likelihood, stored as JSON and applied to each answer's
distribution as the last step of the softmax.

Applying temperature T to a distribution p gives softmax(log p / T). For an answer read from one
branch that is exactly the softmax of the label logprobs at T; for a debiased answer (an average over
rotations) it rescales the average, which is what the fit saw, so fitting and serving agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

CALIBRATION_VERSION = 1
_LOG_T_RANGE = (math.log(0.02), math.log(50.0))  # temperatures searched; beyond them the data says "sharpen/flatten"


class CalibrationError(ValueError):
    """A calibration file is missing, unreadable or not a calibration."""


class TypeTemperatures(BaseModel):
    """The temperature of one question type, with optional overrides by option count."""

    temperature: float = Field(gt=0)
    by_options: dict[int, float] = Field(default_factory=dict)  # option count → temperature
    samples: int = 0  # labelled answers it was fitted on


class Calibration(BaseModel):
    """The file `openjev calibrate` writes and `OPENJEV_CALIBRATION` points at."""

    version: int = CALIBRATION_VERSION
    temperatures: dict[str, TypeTemperatures] = Field(default_factory=dict)  # "noul" | "choice" | "score"

    def temperature(self, kind: str, options: int) -> float:
        """The temperature for a question of `kind` with `options` options (1.0 when not fitted)."""
        fitted = self.temperatures.get(kind)
        if fitted is None:
            return 1.0
        return fitted.by_options.get(options, fitted.temperature)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read a calibration file; CalibrationError says why one cannot be used."""
        try:
            return cls.model_validate_json(Path(path).read_bytes())
        except (OSError, ValueError) as error:
            raise CalibrationError(f"calibration file {path}: {error}") from None


@dataclass(frozen=True)
class LabelledAnswer:
    """One answer's distribution (over its options, at temperature 1) and the index of the right option."""

    kind: str
    probabilities: Sequence[float]
    gold: int


def apply_temperature(probabilities: Sequence[float], temperature: float) -> list[float]:
    """softmax(log p / T); zeros stay zero and T = 1 returns p unchanged."""
    if temperature == 1.0:
        return list(probabilities)
    logs = [math.log(p) if p > 0 else -math.inf for p in probabilities]
    top = max(logs)
    weights = [math.exp((lp - top) / temperature) for lp in logs]
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


def fit_calibration(answers: Sequence[LabelledAnswer], by_options: bool = False, min_bucket: int = 30) -> Calibration:
    """One temperature per question type; with `by_options`, also one per option count that has at least
    `min_bucket` answers (fewer would fit noise)."""
    temperatures: dict[str, TypeTemperatures] = {}
    for kind in sorted({a.kind for a in answers}):
        of_kind = [a for a in answers if a.kind == kind]
        buckets: dict[int, float] = {}
        if by_options:
            for count in sorted({len(a.probabilities) for a in of_kind}):
                bucket = [a for a in of_kind if len(a.probabilities) == count]
                if len(bucket) >= min_bucket:
                    buckets[count] = round(fit_temperature(bucket), 4)
        temperatures[kind] = TypeTemperatures(temperature=round(fit_temperature(of_kind), 4), by_options=buckets,
                                              samples=len(of_kind))
    return Calibration(temperatures=temperatures)
