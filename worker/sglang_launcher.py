"""Builds the SGLang launch command for the configured model (`spec/sglang.md`, 0.5.19–0.5.23)."""

from __future__ import annotations

import os

from common.settings import Frontend, Settings


def sglang_command(settings: Settings, python: str = "python", host: str = "127.0.0.1", port: int = 30000,
                   extra_args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that launch SGLang for `settings` on `host:port`."""
    argv = [python, "-m", "sglang.launch_server",
            "--model-path", settings.model,
            "--served-model-name", settings.served_model_name,
            "--host", host, "--port", str(port),
            "--context-length", str(settings.max_input_tokens),
            "--mamba-radix-cache-strategy", "extra_buffer",
            "--enable-metrics"]
    if settings.revision:
        argv += ["--revision", settings.revision]
    if settings.backend_api_key:
        argv += ["--api-key", settings.backend_api_key.get_secret_value()]
    argv += extra_args or []
    env = dict(os.environ)
    if settings.frontend is Frontend.rust:
        env["SGLANG_RUST_SERVER"] = "1"
    else:
        env.pop("SGLANG_RUST_SERVER", None)
    return argv, env
