"""The SGLang launch command: the flags of `spec/sglang.md`, the frontend switch, pass-through
arguments and the version facts the worker depends on."""

from __future__ import annotations

import sys

import pytest

from common.settings import Frontend, Settings
from worker.sglang_launcher import (
    LaunchArgumentRejected,
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
