"""The reference CPU engine: SGLang's native /generate and /abort_request subset, served with transformers on
CPU (SmolLM2-135M-Instruct by default), with a real prefix KV cache. For development, CI and laptops.

Importing this package does not import torch: the API uses `default_tokenizer_dir` without it.
"""

from worker.cpu_engine.model import default_tokenizer_dir, ensure_converted

__all__ = ["default_tokenizer_dir", "ensure_converted"]
