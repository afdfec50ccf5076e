"""Builds the SGLang launch command for the configured model, with flag names valid on SGLang 0.5.19
through 0.5.23 (README, "SGLang on a CPU"), and knows which of those versions need a workaround. What depends
on the model (hybrid-only flags, the context length) is read from its `config.json` when it is a
local directory or already in the Hugging Face cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.settings import Frontend, Settings, SglangDevice

LAUNCH_MODULE = "sglang.launch_server"

# Flags the launcher sets from the settings; passing them again as extra arguments would silently win.
MANAGED_FLAGS = frozenset({
    "--model-path", "--revision", "--served-model-name", "--host", "--port", "--context-length",
    "--mamba-radix-cache-strategy", "--enable-metrics", "--api-key", "--device", "--max-total-tokens",
})

# SGLang on a CPU without a GPU (OPENJEV_SGLANG_DEVICE=cpu; deploy/install_sglang_cpu.sh installs it):
# its CPU engine with torch-native attention. There is no CUDA graph, and the overlap scheduler and
# busy polling only cost the CPU that the forward passes need.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
             "--sleep-on-idle", "--disable-overlap-schedule")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# On a CPU SGLang would size its KV pool from the machine's free RAM (about 12 GB for SmolLM2 on a
# 24 GB machine); by default it gets room for two full-length prompts instead.
CPU_POOL_CONTEXTS = 2

# Layer types of softmax attention; any other type in a config's `layer_types` (linear attention,
# mamba) makes the model a hybrid whose prefix cache needs the mamba radix cache strategy.
SOFTMAX_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
HYBRID_CONFIG_KEYS = ("full_attention_interval", "linear_conv_kernel_dim", "mamba_d_state", "ssm_state_size")

# Flags that break openjev's scoring or caching, with the reason given to whoever passes them.
FORBIDDEN_FLAGS = {
    "--disable-radix-cache": "the warm call fills the prefix cache that every branch call reads",
}
FORBIDDEN_PREFIXES = {
    "--speculative-": "speculative decoding disables the prefill-only path the branch calls rely on",
}

# Old names that SGLang 0.5.23 no longer accepts; the replacements exist from 0.5.19 on.
RENAMED_FLAGS = {
    "--mamba-scheduler-strategy": "--mamba-radix-cache-strategy",
    "--cuda-graph-max-bs": "--cuda-graph-max-bs-decode",
    "--disable-piecewise-cuda-graph": "--cuda-graph-backend-prefill disabled",
}

# sgl-project/sglang#34719: a batch that mixes requests with and without `token_ids_logprob` crashes
# the scheduler; present in 0.5.19, fixed in 0.5.21.
FIRST_VERSION_WITHOUT_34719 = (0, 5, 21)


class LaunchArgumentRejected(ValueError):
    """An extra SGLang argument openjev cannot run with."""


@dataclass(frozen=True)
class ModelFacts:
    """What the launch command needs to know about the model, from its `config.json`."""

    hybrid: bool  # it has linear-attention or state-space layers beside softmax attention
    context_length: int | None  # its own maximum (max_position_embeddings); None when not stated


# The production model (a hybrid linear-attention MoE) when its config cannot be read before SGLang
# downloads it: a non-hybrid model then fails at start with SGLang's own message, never silently.
ASSUMED_FACTS = ModelFacts(hybrid=True, context_length=None)


def sglang_command(settings: Settings, python: str = "python", host: str = "127.0.0.1", port: int = 30000,
                   extra_args: Iterable[str] = (),
                   base_env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that launch SGLang for `settings` on `host:port`.

    `python`: the interpreter that has SGLang installed. `extra_args`: passed through after ours
    (checked by `check_extra_args`). `base_env`: the environment to extend (default: this process's).
    """
    extra = list(extra_args)
    check_extra_args(extra)
    facts = model_facts(settings.model, settings.revision)
    context = context_length(settings, facts)
    argv = [python, "-m", LAUNCH_MODULE,
            "--model-path", settings.model,
            "--served-model-name", settings.served_model_name,
            "--host", host, "--port", str(port),
            "--context-length", str(context)]
    if facts.hybrid:
        # Caches hybrid linear-attention state at page boundaries so a warmed prefix is reusable;
        # SGLang 0.5.23 refuses the flag for a model without such state.
        argv += ["--mamba-radix-cache-strategy", "extra_buffer"]
    argv.append("--enable-metrics")
    if settings.sglang_device is SglangDevice.cpu:
        argv += CPU_FLAGS
    pool = settings.sglang_max_total_tokens or (
        CPU_POOL_CONTEXTS * context if settings.sglang_device is SglangDevice.cpu else None)
    if pool:
        argv += ["--max-total-tokens", str(pool)]
    if settings.revision:
        argv += ["--revision", settings.revision]
    if settings.backend_api_key:
        argv += ["--api-key", settings.backend_api_key.get_secret_value()]
    return argv + extra, sglang_env(settings, os.environ if base_env is None else base_env)


def sglang_env(settings: Settings, base_env: Mapping[str, str]) -> dict[str, str]:
    """`base_env` with the frontend switch set (SGLang has no `--frontend` flag, only this variable)
    and, on a CPU, the switch to SGLang's CPU engine."""
    env = dict(base_env)
    if settings.frontend is Frontend.rust:
        env["SGLANG_RUST_SERVER"] = "1"
    else:
        env.pop("SGLANG_RUST_SERVER", None)
    if settings.sglang_device is SglangDevice.cpu:
        env |= CPU_ENV
    return env


def context_length(settings: Settings, facts: ModelFacts | None = None) -> int:
    """The context SGLang is started with: `max_input_tokens`, or the model's own when smaller
    (0.5.23 refuses a longer one)."""
    facts = facts or model_facts(settings.model, settings.revision)
    if facts.context_length is None:
        return settings.max_input_tokens
    return min(settings.max_input_tokens, facts.context_length)


def model_facts(model: str, revision: str | None = None) -> ModelFacts:
    """The facts of `model` (a local directory or a hub id) from its `config.json`; `ASSUMED_FACTS`
    when no copy of it is on this machine yet."""
    config = _read_config(model, revision)
    if config is None:
        return ASSUMED_FACTS
    parts = [config, *([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])]
    hybrid = any(_is_hybrid(part) for part in parts)
    lengths = [part["max_position_embeddings"] for part in parts
               if isinstance(part.get("max_position_embeddings"), int)]
    return ModelFacts(hybrid=hybrid, context_length=min(lengths) if lengths else None)


def _is_hybrid(config: dict[str, Any]) -> bool:
    layer_types = config.get("layer_types") or []
    return (any(kind not in SOFTMAX_LAYER_TYPES for kind in layer_types)
            or any(key in config for key in HYBRID_CONFIG_KEYS))


def _read_config(model: str, revision: str | None) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json", revision=revision)
        if not isinstance(cached, str):  # not cached, or cached as missing
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_extra_args(args: Iterable[str]) -> None:
    """Raise `LaunchArgumentRejected` for a flag openjev sets itself, forbids, or that SGLang renamed."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise LaunchArgumentRejected(f"{flag} is set from the OPENJEV_* settings; change the setting instead")
        if flag in FORBIDDEN_FLAGS:
            raise LaunchArgumentRejected(f"{flag} is not allowed: {FORBIDDEN_FLAGS[flag]}")
        for prefix, reason in FORBIDDEN_PREFIXES.items():
            if flag.startswith(prefix):
                raise LaunchArgumentRejected(f"{flag} is not allowed: {reason}")
        if flag in RENAMED_FLAGS:
            raise LaunchArgumentRejected(f"{flag} is gone in SGLang 0.5.23; use {RENAMED_FLAGS[flag]}")


def installed_sglang_version(python: str, timeout: float = 30.0) -> str | None:
    """The version of the `sglang` distribution `python` sees, or None; reads metadata, never imports torch."""
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = done.stdout.strip()
    return version if done.returncode == 0 and version else None


def needs_warm_label_logprobs(version: str | None) -> bool:
    """Whether every call, warm included, must send `token_ids_logprob` (sgl-project/sglang#34719).

    An unknown version counts as affected: the workaround costs one extra logprob, the bug a crashed server.
    """
    release = _release(version)
    return release is None or release < FIRST_VERSION_WITHOUT_34719


def _release(version: str | None) -> tuple[int, ...] | None:
    match = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(part) for part in match.groups()) if match else None
