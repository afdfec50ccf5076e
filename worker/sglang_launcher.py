"""Builds the SGLang launch command for the configured model, with flag names valid on SGLang 0.5.19
through 0.5.23 (`spec/sglang.md`), and knows which of those versions need a workaround."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable, Mapping

from common.settings import Frontend, Settings

LAUNCH_MODULE = "sglang.launch_server"

# Flags the launcher sets from the settings; passing them again as extra arguments would silently win.
MANAGED_FLAGS = frozenset({
    "--model-path", "--revision", "--served-model-name", "--host", "--port", "--context-length",
    "--mamba-radix-cache-strategy", "--enable-metrics", "--api-key",
})

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


def sglang_command(settings: Settings, python: str = "python", host: str = "127.0.0.1", port: int = 30000,
                   extra_args: Iterable[str] = (),
                   base_env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that launch SGLang for `settings` on `host:port`.

    `python`: the interpreter that has SGLang installed. `extra_args`: passed through after ours
    (checked by `check_extra_args`). `base_env`: the environment to extend (default: this process's).
    """
    extra = list(extra_args)
    check_extra_args(extra)
    argv = [python, "-m", LAUNCH_MODULE,
            "--model-path", settings.model,
            "--served-model-name", settings.served_model_name,
            "--host", host, "--port", str(port),
            "--context-length", str(settings.max_input_tokens),
            # Caches hybrid linear-attention state at page boundaries so a warmed prefix is reusable.
            "--mamba-radix-cache-strategy", "extra_buffer",
            "--enable-metrics"]
    if settings.revision:
        argv += ["--revision", settings.revision]
    if settings.backend_api_key:
        argv += ["--api-key", settings.backend_api_key.get_secret_value()]
    return argv + extra, sglang_env(settings, os.environ if base_env is None else base_env)


def sglang_env(settings: Settings, base_env: Mapping[str, str]) -> dict[str, str]:
    """`base_env` with the frontend switch set: SGLang has no `--frontend` flag, only this variable."""
    env = dict(base_env)
    if settings.frontend is Frontend.rust:
        env["SGLANG_RUST_SERVER"] = "1"
    else:
        env.pop("SGLANG_RUST_SERVER", None)
    return env


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
