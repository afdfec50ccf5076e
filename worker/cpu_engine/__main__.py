"""`python -m worker.cpu_engine`: serve the reference CPU engine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from common.settings import Settings
from worker.cpu_engine.model import CpuDtype
from worker.cpu_engine.server import DEFAULT_CACHE_TOKENS, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The engine's command line."""
    parser = argparse.ArgumentParser(prog="python -m worker.cpu_engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--model", default=None,
                        help="HF-format model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "openjev" / "models",
                        help="where GGUF models are converted once (default: ~/.cache/openjev/models)")
    parser.add_argument("--compute-delay", type=float, default=0.0,
                        help="seconds to sleep, abortably, per prompt before its compute (tests)")
    parser.add_argument("--cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS,
                        help="prefix KV cache capacity in tokens (about 46 KB each for SmolLM2-135M)")
    parser.add_argument("--dtype", choices=get_args(CpuDtype), default=Settings().cpu_dtype,
                        help="compute dtype (default: OPENJEV_CPU_DTYPE, else auto: bfloat16 on CPUs with bf16 "
                             "instructions, float32 elsewhere; int8: faster without bf16, at a cost in answers)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until interrupted."""
    args = parse_args(argv)
    run(args.host, args.port, args.model, args.cache_dir, args.compute_delay, args.cache_tokens, args.dtype)


if __name__ == "__main__":
    main()
