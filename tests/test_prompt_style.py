"""The prompt style: the alternative answer form ("Answer:", a newline, the bare label) compiles to the same
prefix, and each label is still one verified token right after the marker."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import PreTrainedTokenizerBase

from common.contract import SystemOneRequest
from common.prompt import PromptCompiler
from common.settings import PromptStyle
from common.tokenizer import qwen36_tokenizer, smollm2_tokenizer

REQUEST = SystemOneRequest.model_validate({
    "model": "jev-latest", "state": "Ticket: charged twice.",
    "questions": {"team": {"type": "choice", "criteria": {"Billing": None, "Sales": None}}}})


@pytest.mark.parametrize("load", [smollm2_tokenizer, qwen36_tokenizer])
def test_newline_style_scores_bare_labels_after_the_marker_line(load: Callable[[], PreTrainedTokenizerBase]) -> None:
    tokenizer = load()
    inline = PromptCompiler.for_tokenizer(tokenizer).compile(REQUEST)
    newline_compiler = PromptCompiler.for_tokenizer(tokenizer, style=PromptStyle.newline)
    newline = newline_compiler.compile(REQUEST)
    assert newline.prefix_ids == inline.prefix_ids
    suffix = tokenizer.decode(newline.branches[0].suffix_ids)
    assert suffix.endswith("Answer:\n")
    labels = newline_compiler.alphabet.labels_for(2)
    assert [label.text for label in labels] == ["A", "B"]
    whole = tokenizer.decode(newline.prefix_ids + newline.branches[0].suffix_ids)
    for label in labels:
        ids = tokenizer.encode(whole + label.text, add_special_tokens=False)
        assert ids == [*newline.prefix_ids, *newline.branches[0].suffix_ids, label.token_id]
