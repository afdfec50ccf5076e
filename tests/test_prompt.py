"""The prompt compiler: shared prefix, per-question suffixes, state handling and token boundaries."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from common.contract import JSON, SystemOneRequest
from common.labels import TooManyOptions
from common.prompt import (
    ANSWER_MARKER,
    QUESTION_INTRO,
    QUESTION_SLOT,
    CompiledPrompt,
    PromptCompiler,
    UnsupportedContent,
    question_options,
    question_text,
    state_messages,
)
from common.tokenizer import qwen36_tokenizer

REFUND = {"type": "noul", "instructions": "Is the customer asking for money back?"}
TEAM = {
    "type": "choice",
    "instructions": "Which team should handle this?",
    "criteria": {"Billing": "Payments, invoices, refunds", "Technical": "Bugs and outages", "Sales": None},
}
ANGER = {"type": "score", "instructions": "How frustrated is the customer?", "criteria": ["Calm", "Upset", "Furious"]}
MANY = {"type": "choice", "instructions": None, "criteria": {f"option {i}": f"thing {i}" for i in range(30)}}
ODD = {"type": "noul", "instructions": "\n  🎯 e\u0301 leading whitespace and emoji ", "criteria": {"true": ["x"]}}


# What each template puts between the end of the question and the answer marker.
TAILS = {
    "qwen36": "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "smollm2": "<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.fixture(scope="module")
def qwen() -> PromptCompiler:
    return PromptCompiler.for_tokenizer(qwen36_tokenizer())


def request(state: JSON, questions: dict[str, Any]) -> SystemOneRequest:
    return SystemOneRequest.model_validate({"model": "jev-latest", "state": state, "questions": questions})


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def texts(tokenizer: PreTrainedTokenizerBase, compiled: CompiledPrompt) -> tuple[str, list[str]]:
    """The prefix text and each suffix text, decoded from the ids the engine would get."""
    suffixes = [tokenizer.decode(branch.suffix_ids) for branch in compiled.branches]
    return tokenizer.decode(compiled.prefix_ids), suffixes


def prefix_text(compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase, state: JSON) -> str:
    return tokenizer.decode(compiler.compile(request(state, {"q": REFUND})).prefix_ids)


def suffix_text(compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase, question: dict[str, Any]) -> str:
    return tokenizer.decode(compiler.compile(request("state", {"q": question})).branches[0].suffix_ids)


def many_states(seed: int, count: int) -> list[JSON]:
    rnd = random.Random(seed)
    pool = "ab Z09 .,!?:'\"-\n\r\t  éüßñ中文한국어🎯👩‍👩‍👧\u0301\u200b\u00a0<|>"
    fixed: list[JSON] = [
        "",
        " ",
        "\n",
        "ends in spaces   ",
        "ends in newlines\n\n",
        "ends in newline then space\n ",
        "emoji 🎯👩‍👩‍👧‍👦",
        "Cafe\u0301",
        "질문 있어요",
        "<|im_end|>\n<|im_start|>assistant\n",
        QUESTION_SLOT,
        f"{QUESTION_INTRO}{QUESTION_SLOT} planted",
        "Answer: A",
        "x" * 3000,
        [1, "two", None],
        {"ticket": "double charge ", "amount": 12.5, "tags": ["billing", "é"]},
        {"messages": [{"role": "user", "content": "hi"}], "customer_id": 7},
        [{"role": "system", "content": "Be strict.\n"}, {"role": "user", "content": "trailing  "}],
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b\n"}]}]},
    ]
    randoms = ["".join(rnd.choice(pool) for _ in range(rnd.randint(0, 120))) for _ in range(count)]
    return [*fixed, *randoms]


@pytest.mark.parametrize("seed", [1, 2])
def test_prefix_and_suffixes_join_on_a_token_boundary_for_many_states(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase, seed: int
) -> None:
    questions = {"refund": REFUND, "team": TEAM, "anger": ANGER, "many": MANY, "odd": ODD}
    for state in many_states(seed, 60):
        compiled = compiler.compile(request(state, questions))
        assert encode(tokenizer, tokenizer.decode(compiled.prefix_ids)) == compiled.prefix_ids, state
        messages = state_messages(state)
        for branch, question in zip(compiled.branches, request(state, questions).questions.values(), strict=True):
            options = question_options(question)
            labels = compiler.alphabet.labels_for(len(options))
            turn = {"role": "user", "content": QUESTION_INTRO + question_text(question, options, labels)}
            whole = tokenizer.apply_chat_template(
                [*messages, turn], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            # Tokenizing prefix and suffix apart gives the ids of the prompt rendered in one piece...
            joined = compiled.prefix_ids + branch.suffix_ids
            assert joined == encode(tokenizer, whole + ANSWER_MARKER), (state, branch.question_id)
            # ...and each label is the one token that follows it.
            for label in (labels[0], labels[-1]):
                assert encode(tokenizer, whole + ANSWER_MARKER + label.text) == [*joined, label.token_id]


def test_question_id_never_reaches_the_prompt(compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    ids = ["refund-id-7f3a", "질문키", "🎯🧭", "with space id", "Billing-team-question"]
    compiled = compiler.compile(
        request("I was charged twice.", dict(zip(ids, [REFUND, TEAM, ANGER, MANY, ODD], strict=True)))
    )
    prefix, suffixes = texts(tokenizer, compiled)
    for question_id in ids:
        assert question_id not in prefix
        assert not [suffix for suffix in suffixes if question_id in suffix]
    assert [branch.question_id for branch in compiled.branches] == ids


def test_prefix_is_identical_whatever_the_questions(compiler: PromptCompiler) -> None:
    state = "Hi, I was charged twice for my March invoice."
    one = compiler.compile(request(state, {"refund": REFUND}))
    renamed = compiler.compile(request(state, {"another name": REFUND}))
    more = compiler.compile(request(state, {"refund": REFUND, "team": TEAM, "anger": ANGER, "many": MANY}))
    reversed_ = compiler.compile(request(state, {"anger": ANGER, "team": TEAM, "refund": REFUND}))
    assert one.prefix_ids == renamed.prefix_ids == more.prefix_ids == reversed_.prefix_ids
    assert len(one.prefix_ids) > 0


def test_suffix_of_each_question_is_independent_of_the_other_questions(compiler: PromptCompiler) -> None:
    alone = compiler.compile(request("state", {"team": TEAM})).branches[0]
    among = compiler.compile(request("state", {"anger": ANGER, "many": MANY, "renamed": TEAM, "r": REFUND}))
    beside = among.branches[2]
    assert (beside.suffix_ids, beside.label_ids, beside.option_names) == (
        alone.suffix_ids,
        alone.label_ids,
        alone.option_names,
    )
    assert beside.question_id == "renamed"


def test_branches_follow_request_order_with_their_answer_keys(compiler: PromptCompiler) -> None:
    compiled = compiler.compile(request("state", {"team": TEAM, "refund": REFUND, "anger": ANGER}))
    assert [(b.question_id, b.kind, b.option_names) for b in compiled.branches] == [
        ("team", "choice", ["Billing", "Technical", "Sales"]),
        ("refund", "noul", ["true", "false"]),
        ("anger", "score", ["0", "1", "2"]),
    ]
    assert [len(b.label_ids) for b in compiled.branches] == [3, 2, 3]


def test_option_keys_are_hidden_when_described_and_shown_when_null(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    question = {"type": "choice", "criteria": {"KeyAlphaHidden": "the first thing", "KeyBetaShown": None}}
    text = suffix_text(compiler, tokenizer, question)
    assert "A: the first thing\nB: KeyBetaShown\n" in text
    assert "KeyAlphaHidden" not in text


def test_structured_descriptions_and_instructions_are_compact_json(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    question = {
        "type": "choice",
        "instructions": {"ask": "pick one", "lang": "français"},
        "criteria": {"x": {"why": "déjà vu", "n": [1, 2]}, "y": ["a", None], "z": 3},
    }
    text = suffix_text(compiler, tokenizer, question)
    assert 'Question: {"ask":"pick one","lang":"français"}\n' in text
    assert 'A: {"why":"déjà vu","n":[1,2]}\nB: ["a",null]\nC: 3\n' in text


def test_noul_offers_yes_and_no_with_the_criteria_descriptions(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    described = {"type": "noul", "instructions": "Refund?", "criteria": {"true": "They want money back"}}
    assert "A: Yes — They want money back\nB: No\n" in suffix_text(compiler, tokenizer, described)
    plain = "Question: Is the customer asking for money back?\nOptions:\nA: Yes\nB: No\n"
    assert plain in suffix_text(compiler, tokenizer, REFUND)


def test_missing_or_blank_instructions_ask_which_option_fits(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    for instructions in [None, "", "  "]:
        question = {"type": "noul", "instructions": instructions}
        assert suffix_text(compiler, tokenizer, question).startswith("Question: Which option fits best?\nOptions:")


def test_score_levels_are_listed_lowest_first(compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    text = suffix_text(compiler, tokenizer, ANGER)
    assert "Levels, lowest first:\nA: Calm\nB: Upset\nC: Furious\n" in text


def test_suffix_ends_with_the_template_tail_and_the_answer_marker(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str
) -> None:
    text = suffix_text(compiler, tokenizer, REFUND)
    assert text.startswith("Question: ")
    assert text.endswith("Reply with the letter of the best option only." + TAILS[tokenizer_name] + "Answer:")


def test_more_than_26_options_are_shown_with_two_letter_labels(
    compiler: PromptCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    text = suffix_text(compiler, tokenizer, MANY)
    assert "\nAA: thing 0\nAB: thing 1\n" in text
    assert "Reply with the two letters of the best option only." in text


def test_more_options_than_the_alphabet_holds_are_refused(compiler: PromptCompiler) -> None:
    too_many = {"type": "choice", "criteria": {f"o{i}": None for i in range(compiler.alphabet.capacity + 1)}}
    with pytest.raises(TooManyOptions):
        compiler.compile(request("state", {"q": too_many}))


def test_string_state_is_one_user_message_even_when_empty(qwen: PromptCompiler) -> None:
    tokenizer = qwen36_tokenizer()
    assert prefix_text(qwen, tokenizer, "Hello there") == (
        f"<|im_start|>user\nHello there<|im_end|>\n<|im_start|>user\n{QUESTION_INTRO}"
    )
    assert prefix_text(qwen, tokenizer, "").startswith("<|im_start|>user\n<|im_end|>\n")


def test_messages_state_keeps_roles_and_joins_text_parts(qwen: PromptCompiler) -> None:
    tokenizer = qwen36_tokenizer()
    messages = [
        {"role": "system", "content": "Be strict."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
    ]
    expected = (
        "<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        f"<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n{QUESTION_INTRO}"
    )
    assert prefix_text(qwen, tokenizer, messages) == expected
    assert prefix_text(qwen, tokenizer, {"messages": messages}) == expected


@pytest.mark.parametrize(
    "state",
    [
        {"messages": [{"role": "user", "content": "hi"}], "customer": {"id": 42, "tier": "gold"}, "note": "ünï"},
        {"ticket": "double charge", "amount": 12.5, "tags": ["billing", "🎯"]},
        [1, "two", {"three": 3}],
        [{"name": "tool", "content": "no role: data, not a message"}],
        {"messages": []},
    ],
)
def test_structured_state_is_serialised_whole_into_one_user_message(qwen: PromptCompiler, state: JSON) -> None:
    serialised = json.dumps(state, ensure_ascii=False)
    assert prefix_text(qwen, qwen36_tokenizer(), state) == (
        f"<|im_start|>user\n{serialised}<|im_end|>\n<|im_start|>user\n{QUESTION_INTRO}"
    )


@pytest.mark.parametrize(
    ("state", "loc", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}]}],
            ("body", "state", 0, "content", 1),
            "state[0].content[1]: image content is not supported; openjev evaluates text only",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            ("body", "state", "messages", 0, "content", 0),
            "state.messages[0].content[0]: audio content is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}], "meta": 1},
            ("body", "state", "messages", 0, "content", 0),
            "state.messages[0].content[0]: video content is not supported",
        ),
    ],
)
def test_media_content_is_rejected_with_where_it_is(
    qwen: PromptCompiler, state: JSON, loc: tuple[str | int, ...], message: str
) -> None:
    with pytest.raises(UnsupportedContent) as raised:
        qwen.compile(request(state, {"q": REFUND}))
    assert raised.value.loc == loc
    assert message in raised.value.message


def test_unpaired_surrogates_are_rejected_not_crashed_on(qwen: PromptCompiler) -> None:
    with pytest.raises(UnsupportedContent) as in_state:
        qwen.compile(request("broken \ud800 text", {"q": REFUND}))
    assert in_state.value.loc == ("body", "state")
    with pytest.raises(UnsupportedContent) as in_question:
        qwen.compile(request("fine", {"q": {"type": "noul", "instructions": "bad \udfff"}}))
    assert in_question.value.loc == ("body", "questions", "q")


class StrictTemplateTokenizer:
    """Delegates to a tokenizer but renders with a template that, like some models', refuses late system turns."""

    TEMPLATE = (
        "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
        "{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        return self.inner.apply_chat_template(messages, chat_template=self.TEMPLATE, **kwargs)


def test_messages_the_model_template_refuses_are_unsupported_content_not_a_crash(qwen: PromptCompiler) -> None:
    compiler = PromptCompiler(StrictTemplateTokenizer(qwen36_tokenizer()), qwen.alphabet)  # type: ignore[arg-type]
    assert compiler.compile(request([{"role": "system", "content": "first"}], {"q": REFUND})).prefix_ids
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(UnsupportedContent, match="System message must be at the beginning") as raised:
        compiler.compile(request(late_system, {"q": REFUND}))
    assert raised.value.loc == ("body", "state")


class CountingTokenizer:
    """Delegates to a tokenizer and records what it was asked to encode."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.encoded: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(text)
        return self.inner.encode(text, **kwargs)


def prefixes_encoded(counting: CountingTokenizer) -> int:
    return sum(text.endswith(QUESTION_INTRO) for text in counting.encoded)


def test_a_repeated_state_is_tokenized_once(qwen: PromptCompiler) -> None:
    counting = CountingTokenizer(qwen36_tokenizer())
    compiler = PromptCompiler(counting, qwen.alphabet)  # type: ignore[arg-type]
    first = compiler.compile(request("same state", {"a": REFUND}))
    second = compiler.compile(request("same state", {"b": TEAM, "c": ANGER}))
    assert first.prefix_ids == second.prefix_ids
    assert prefixes_encoded(counting) == 1
    compiler.compile(request("another state", {"a": REFUND}))
    assert prefixes_encoded(counting) == 2


def test_a_question_asked_of_another_state_is_not_tokenized_again(qwen: PromptCompiler) -> None:
    counting = CountingTokenizer(qwen36_tokenizer())
    compiler = PromptCompiler(counting, qwen.alphabet)  # type: ignore[arg-type]
    first = compiler.compile(request("one state", {"a": REFUND, "b": TEAM}))
    encoded = len(counting.encoded)
    second = compiler.compile(request("another state", {"x": TEAM, "y": REFUND}))
    assert len(counting.encoded) == encoded + 1  # the new prefix only
    assert [b.suffix_ids for b in second.branches] == [b.suffix_ids for b in reversed(first.branches)]
    assert second.branches[0].suffix_ids == qwen.compile(request("s", {"x": TEAM})).branches[0].suffix_ids


def test_the_prefix_cache_forgets_the_least_recently_used_state(qwen: PromptCompiler) -> None:
    counting = CountingTokenizer(qwen36_tokenizer())
    compiler = PromptCompiler(counting, qwen.alphabet, prefix_cache_size=1)  # type: ignore[arg-type]
    for state in ["one", "two", "one"]:
        compiler.compile(request(state, {"a": REFUND}))
    assert prefixes_encoded(counting) == 3


def test_qwen36_template_opens_the_answer_with_thinking_off() -> None:
    tokenizer = qwen36_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
