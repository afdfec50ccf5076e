"""Answer labels: the tokens whose log-probabilities become answers, verified against the live tokenizer."""

from __future__ import annotations

import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

SINGLE_LETTER_OPTIONS = 26
WANTED_CAPACITY = 255
"""Options the official service allows per question; fallback label sets are added until this is reached."""

_UPPER = string.ascii_uppercase
_LOWER = string.ascii_lowercase
# Two-letter label sets in order of preference; a later set is used only while the earlier ones
# together fall short of WANTED_CAPACITY, so the outcome is a pure function of the vocabulary.
_TWO_LETTER_SETS = ((_UPPER, _UPPER), (_UPPER, _LOWER), (_LOWER, _LOWER), (_LOWER, _UPPER))


class LabelAlphabetError(ValueError):
    """The tokenizer cannot provide the 26 single-token letter labels every question relies on."""


class TooManyOptions(ValueError):
    """A question has more options than the tokenizer can give distinct single-token labels."""


@dataclass(frozen=True)
class Label:
    """One answer label: its text as it follows the answer marker (" A") and its token id."""

    text: str
    token_id: int

    @property
    def letters(self) -> str:
        """The label as shown in front of an option ("A" in "A: Billing")."""
        return self.text.strip()


@dataclass(frozen=True)
class LabelAlphabet:
    """Single letters for up to 26 options, two letters for every label of a larger question."""

    single: tuple[Label, ...]
    double: tuple[Label, ...]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, answer_context: str, spacer: str = " ") -> LabelAlphabet:
        """Verify labels with `tokenizer` right after `answer_context`, the text that ends with the answer marker.

        `spacer`: what goes between the marker and the letters (" A" after "Answer:", "A" after a newline).
        """
        verify = _LabelCheck(tokenizer, answer_context)
        single = tuple(verify.all(f"{spacer}{letter}" for letter in _UPPER))
        if len(single) < SINGLE_LETTER_OPTIONS:
            missing = sorted(set(_UPPER) - {label.letters for label in single})
            raise LabelAlphabetError(
                f"the tokenizer does not encode the letters {', '.join(missing)} as single tokens after "
                f"{answer_context[-20:]!r}: it cannot label answer options"
            )
        return cls(single=single, double=tuple(_two_letter_labels(verify, spacer)))

    @property
    def capacity(self) -> int:
        """The most options one question can have."""
        return max(len(self.single), len(self.double))

    def labels_for(self, n: int) -> list[Label]:
        """Labels for a question with `n` options: single letters up to 26, else two letters for all."""
        if n > self.capacity:
            raise TooManyOptions(
                f"a question can have at most {self.capacity} options with this model's tokenizer; got {n}"
            )
        pool = self.single if n <= len(self.single) else self.double
        return list(pool[:n])


class _LabelCheck:
    """Whether a label text is one token in context: same prefix ids, one more id, decodes back to itself."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, answer_context: str) -> None:
        self._tokenizer = tokenizer
        self._context = answer_context
        self._context_ids = self._encode(answer_context)
        self._seen: set[int] = set()

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def label(self, text: str) -> Label | None:
        ids = self._encode(self._context + text)
        n = len(self._context_ids)
        if len(ids) != n + 1 or ids[:n] != self._context_ids:
            return None
        token_id = ids[n]
        if token_id in self._seen or self._tokenizer.decode([token_id]) != text:
            return None
        self._seen.add(token_id)
        return Label(text=text, token_id=token_id)

    def all(self, texts: Iterable[str]) -> Iterator[Label]:
        for text in texts:
            label = self.label(text)
            if label is not None:
                yield label


def _two_letter_labels(verify: _LabelCheck, spacer: str) -> list[Label]:
    labels: list[Label] = []
    for firsts, seconds in _TWO_LETTER_SETS:
        if len(labels) >= WANTED_CAPACITY:
            break
        labels.extend(verify.all(f"{spacer}{a}{b}" for a in firsts for b in seconds))
    return labels
