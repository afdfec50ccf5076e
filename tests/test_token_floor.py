"""Cheap limits first: a state that cannot fit the token budget is refused from a lower bound on its
tokens, found without tokenizing it all, and the bound never refuses a state that fits."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from transformers import PreTrainedTokenizerBase

from api.preparation import JobPreparer
from common.contract import SystemOneRequest
from common.prompt import PromptCompiler
from common.settings import Settings
from common.token_floor import PIECE_CHARS, TokenFloor

WORDS = ["the", "customer", "asked", "about", "a", "refund", "order", "12345", "x2", "émigré", "数据", "naïve",
         "!!", "—", "don't", "<|im_start|>", "<|endoftext|>", "\n", "\n\n", "   ", "\t", "🙂", "Ω", "_id", "e\u0301"]


def ticket_text(chars: int, seed: int, separators: str = " \n") -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return "".join(word + (rng.choice(separators) if separators else "") for word in words)


def ask(state: str, questions: int = 1) -> SystemOneRequest:
    return SystemOneRequest.model_validate({"model": "jev-latest", "state": state,
                                            "questions": {f"q{i}": {"type": "noul"} for i in range(questions)}})


@pytest.mark.parametrize("seed", range(12))
def test_the_floor_never_exceeds_the_token_count(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    floor = TokenFloor(tokenizer)
    text = ticket_text(PIECE_CHARS * 5 + seed * 997, seed, ["", " ", "\n", " \n"][seed % 4])
    count = len(tokenizer.encode(text, add_special_tokens=False))
    whole = floor.at_least(text, limit=count)  # never past the limit: the whole text is counted
    assert count - 10 <= whole <= count  # a sound bound, and a close one (one token of slack per cut)
    assert floor.at_least(text, limit=count - 1) <= count  # from its words, or its pieces: never more
    assert floor.at_least(text, limit=count // 4) <= count  # stopped early: still no more than the count


def test_a_huge_state_is_refused_in_well_under_a_second(compiler: PromptCompiler, tmp_path: Path) -> None:
    preparer = JobPreparer(Settings(cache_dir=tmp_path), compiler)
    state = ticket_text(1_900_000, 1)
    started = time.perf_counter()
    with pytest.raises(RequestValidationError) as refused:
        preparer.prepare(ask(state), "req_huge", 60)
    assert time.perf_counter() - started < 1.0  # tokenizing it whole takes ~4 s
    (error,) = refused.value.errors()
    assert (error["loc"], error["type"]) == (["body", "state"], "token_budget")


def test_six_huge_states_at_once_are_each_refused_within_a_second(compiler: PromptCompiler, tmp_path: Path) -> None:
    preparer = JobPreparer(Settings(cache_dir=tmp_path), compiler)
    states = [ticket_text(1_900_000, seed) for seed in range(6)]

    def refuse(state: str) -> float:
        started = time.perf_counter()
        with pytest.raises(RequestValidationError):
            preparer.prepare(ask(state), "req_huge", 60)
        return time.perf_counter() - started

    with ThreadPoolExecutor(6) as pool:
        assert max(pool.map(refuse, states)) < 1.0


@pytest.mark.parametrize("questions", [1, 8])
def test_a_state_that_fits_exactly_is_never_refused(compiler: PromptCompiler, tmp_path: Path, questions: int) -> None:
    state = ticket_text(PIECE_CHARS * 3, 4)
    needed = JobPreparer(Settings(cache_dir=tmp_path), compiler).prepare(ask(state, questions), "r", 60)
    per_branch = max(len(needed.prefix_ids) + len(b.suffix_ids) + 1 for b in needed.branches)
    exact = Settings(cache_dir=tmp_path, max_input_tokens=per_branch, max_total_input_tokens=needed.total_input_tokens)
    assert JobPreparer(exact, compiler).prepare(ask(state, questions), "r", 60).prefix_ids == needed.prefix_ids
    tight = Settings(cache_dir=tmp_path, max_input_tokens=per_branch - 1)
    with pytest.raises(RequestValidationError):
        JobPreparer(tight, compiler).prepare(ask(state, questions), "r", 60)
