"""The SGLang launch command: the flags worker/sglang_launcher.py documents, the frontend switch, pass-through
arguments and the version facts the worker depends on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.settings import Frontend, Settings, SglangDevice
from worker.sglang_launcher import (
    LaunchArgumentRejected,
    ModelFacts,
    check_extra_args,
    installed_sglang_version,
    needs_warm_label_logprobs,
    sglang_command,
)


def settings(**overrides: object) -> Settings:
    return Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def flag(argv: list[str], name: str) -> str | None:
    """The value after `name` in argv (None when absent)."""
    return argv[argv.index(name) + 1] if name in argv else None


def test_command_launches_the_configured_model_with_the_spec_flags() -> None:
    argv, _ = sglang_command(settings(max_input_tokens=16384), python="/opt/sglang/bin/python", port=31000)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "nvidia/Qwen3.6-35B-A3B-NVFP4"
    assert flag(argv, "--served-model-name") == "Qwen/Qwen3.6-35B-A3B"
    assert flag(argv, "--context-length") == "16384"
    assert flag(argv, "--mamba-radix-cache-strategy") == "extra_buffer"
    assert "--enable-metrics" in argv
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "31000")


def test_command_never_disables_the_radix_cache_nor_speculates_nor_picks_a_quantization() -> None:
    argv, _ = sglang_command(settings(revision="abc123", backend_api_key="k"))
    assert "--disable-radix-cache" not in argv
    assert not [a for a in argv if a.startswith("--speculative")]
    assert "--quantization" not in argv  # NVFP4 checkpoints are auto-detected


def test_revision_and_backend_key_are_passed_only_when_set() -> None:
    bare, _ = sglang_command(settings())
    assert "--revision" not in bare and "--api-key" not in bare
    pinned, _ = sglang_command(settings(revision="0123abcd", backend_api_key="s3cret"))
    assert flag(pinned, "--revision") == "0123abcd"
    assert flag(pinned, "--api-key") == "s3cret"


def test_rust_frontend_sets_the_environment_switch_and_python_clears_it() -> None:
    _, env = sglang_command(settings(frontend=Frontend.rust), base_env={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "SGLANG_RUST_SERVER": "1"}
    _, env = sglang_command(settings(frontend=Frontend.python), base_env={"PATH": "/bin", "SGLANG_RUST_SERVER": "1"})
    assert env == {"PATH": "/bin"}


def test_environment_defaults_to_this_process_plus_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", "/cache/huggingface")
    _, env = sglang_command(settings())
    assert env["HF_HOME"] == "/cache/huggingface" and env["SGLANG_RUST_SERVER"] == "1"


def test_extra_arguments_pass_through_after_ours() -> None:
    extra = ["--mem-fraction-static", "0.85", "--cuda-graph-max-bs-decode=64"]
    argv, _ = sglang_command(settings(), extra_args=extra)
    assert argv[-3:] == extra


@pytest.mark.parametrize("args", [
    ["--disable-radix-cache"],
    ["--speculative-algorithm", "EAGLE"],
    ["--speculative-num-steps=3"],
    ["--port", "1"],
    ["--context-length=4096"],
    ["--mamba-radix-cache-strategy", "no_buffer"],
    ["--device", "cpu"],
    ["--max-total-tokens=16384"],
])
def test_extra_arguments_that_break_caching_or_shadow_settings_are_rejected(args: list[str]) -> None:
    with pytest.raises(LaunchArgumentRejected):
        sglang_command(settings(), extra_args=args)


@pytest.mark.parametrize(("old", "new"), [
    ("--mamba-scheduler-strategy", "--mamba-radix-cache-strategy"),
    ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"),
    ("--disable-piecewise-cuda-graph", "--cuda-graph-backend-prefill"),
])
def test_flags_renamed_by_0_5_23_are_rejected_with_their_new_name(old: str, new: str) -> None:
    with pytest.raises(LaunchArgumentRejected, match=new):
        check_extra_args([old, "1"])


@pytest.mark.parametrize(("version", "affected"), [
    ("0.5.19", True), ("0.5.19.post2", True), ("0.5.20", True), ("0.5.21", False), ("0.5.23", False),
    ("v0.5.22rc1", False), ("0.6.0", False), (None, True), ("unknown", True),
])
def test_versions_before_0_5_21_send_label_ids_on_the_warm_call(version: str | None, affected: bool) -> None:
    assert needs_warm_label_logprobs(version) is affected


def test_installed_version_is_read_from_metadata_without_importing(tmp_path) -> None:
    dist = tmp_path / "sglang-0.5.19.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.19\n")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} \"$@\"\n")
    fake_python.chmod(0o755)
    assert installed_sglang_version(str(fake_python)) == "0.5.19"
    assert installed_sglang_version(sys.executable) is None  # not installed here
    assert installed_sglang_version(str(tmp_path / "missing")) is None


def model_dir_with(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
                  "num_hidden_layers": 30}
# The shape of Qwen3.6-35B-A3B's config: a hybrid of linear (Gated DeltaNet) and full attention layers.
HYBRID_CONFIG = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                 "text_config": {"layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                                 "full_attention"], "full_attention_interval": 4,
                                 "max_position_embeddings": 262144}}


def test_a_model_without_linear_attention_gets_no_hybrid_flags_and_its_own_shorter_context(tmp_path: Path) -> None:
    # SGLang 0.5.23 refuses both for SmolLM2: "needs mamba state, got LlamaForCausalLM", and a
    # context length above the model's 8192.
    argv, _ = sglang_command(settings(model=model_dir_with(tmp_path, SMOLLM2_CONFIG)))
    assert "--mamba-radix-cache-strategy" not in argv
    assert flag(argv, "--context-length") == "8192"


def test_a_hybrid_model_keeps_the_extra_buffer_cache_and_the_configured_context(tmp_path: Path) -> None:
    argv, _ = sglang_command(settings(model=model_dir_with(tmp_path, HYBRID_CONFIG), max_input_tokens=32768))
    assert flag(argv, "--mamba-radix-cache-strategy") == "extra_buffer"
    assert flag(argv, "--context-length") == "32768"


def test_the_configured_context_wins_when_it_is_the_smaller(tmp_path: Path) -> None:
    argv, _ = sglang_command(settings(model=model_dir_with(tmp_path, SMOLLM2_CONFIG), max_input_tokens=4096))
    assert flag(argv, "--context-length") == "4096"


def facts_in_a_fresh_process(model: str, hub_cache: Path) -> str:
    """`model_facts(model)` with `hub_cache` as the Hugging Face cache (read once, at import)."""
    probe = f"from worker.sglang_launcher import model_facts; print(model_facts({model!r}))"
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "HF_HUB_CACHE": str(hub_cache)},
                          capture_output=True, text=True, timeout=60, check=True, cwd=Path(__file__).parent.parent)
    return done.stdout.strip()


def test_a_hub_model_whose_config_is_not_here_yet_is_taken_for_the_production_hybrid(tmp_path: Path) -> None:
    assert facts_in_a_fresh_process("org/not-downloaded", tmp_path) == repr(ModelFacts(hybrid=True,
                                                                                       context_length=None))


def test_a_hub_model_in_the_local_cache_is_read_from_there(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--small"
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert facts_in_a_fresh_process("org/small", tmp_path) == repr(ModelFacts(hybrid=False, context_length=8192))


def test_the_cpu_device_adds_sglangs_cpu_engine_flags_and_switch() -> None:
    argv, env = sglang_command(settings(sglang_device=SglangDevice.cpu), base_env={})
    assert flag(argv, "--device") == "cpu"
    assert flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--dtype") == "float32"
    assert {"--sleep-on-idle", "--disable-overlap-schedule"} <= set(argv)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    gpu_argv, gpu_env = sglang_command(settings(), base_env={})
    assert "--device" not in gpu_argv and "SGLANG_USE_CPU_ENGINE" not in gpu_env


def test_on_a_cpu_the_kv_pool_is_capped_at_two_contexts_unless_set(tmp_path: Path) -> None:
    # Uncapped, SGLang on a CPU took 12 GB of RAM for SmolLM2's KV pool.
    model = model_dir_with(tmp_path, SMOLLM2_CONFIG)
    argv, _ = sglang_command(settings(model=model, sglang_device=SglangDevice.cpu))
    assert flag(argv, "--max-total-tokens") == "16384"
    argv, _ = sglang_command(settings(model=model, sglang_device=SglangDevice.cpu, sglang_max_total_tokens=4096))
    assert flag(argv, "--max-total-tokens") == "4096"
    gpu_argv, _ = sglang_command(settings())
    assert "--max-total-tokens" not in gpu_argv  # on a GPU SGLang sizes it from free memory
    gpu_argv, _ = sglang_command(settings(sglang_max_total_tokens=500000))
    assert flag(gpu_argv, "--max-total-tokens") == "500000"
