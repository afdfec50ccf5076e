"""What projecting the logits in float32 costs a bfloat16 CPU model (worker/cpu_engine/head.py): the same
loaded model, its output projection swapped between the bfloat16 original and the float32 copy, rounds
alternating, in one process. Times a ~250-token prefill from nothing and an 8-token step after it (a branch
call's shape), and says how many of the last position's logits sit on bfloat16's grid.

    uv run --extra cpu --extra dev [--extra qwen] python -m bench.cpu_head [--model qwen2.5-1.5b] [--rounds 5]

Figures: bench/RESULTS-quality.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common.contract import EXAMPLE_REQUEST
from common.settings import Settings
from worker.cpu_engine.model import DEFAULT_MODEL, load_model, resolve_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a catalog model (default {DEFAULT_MODEL})")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch

    model_dir, served_name = resolve_model(args.model, Settings().cache_dir / "models")
    loaded = load_model(model_dir, served_name, dtype="bfloat16")  # with its float32 projection
    heads = {"float32 projection": loaded.model.get_output_embeddings()}
    original = heads["float32 projection"]
    heads["bfloat16 projection"] = torch.nn.Linear(original.weight.shape[1], original.weight.shape[0],
                                                   bias=original.bias is not None, dtype=torch.bfloat16)
    heads["bfloat16 projection"].weight = torch.nn.Parameter(original.weight.detach().bfloat16(), requires_grad=False)
    state = EXAMPLE_REQUEST["state"]
    prompt = loaded.tokenizer(" ".join([state] * 12)).input_ids[:250]
    step = loaded.tokenizer(" Which team should handle this? Answer:").input_ids[:8]
    timings: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in heads}
    on_grid: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, head in heads.items():
            loaded.model.set_output_embeddings(head)
            started = time.perf_counter()
            _, kv = loaded.forward(prompt, None)
            prefilled = time.perf_counter()
            logits, _ = loaded.forward(step, kv)
            stepped = time.perf_counter()
            timings[name][0].append(prefilled - started)
            timings[name][1].append(stepped - prefilled)
            on_grid[name] = (logits.bfloat16().float() == logits).float().mean().item()
    print(f"{args.model} in bfloat16, {torch.get_num_threads()} threads, {args.rounds} rounds alternating; "
          f"the float32 copy of the projection holds {original.weight.numel() * 4 / 2**20:.0f} MiB")
    print("| projection | prefill 250 tokens, median s | 8-token step after it, median ms "
          "| logits on bfloat16's grid |")
    print("|---|---|---|---|")
    for name, (prefill, steps) in timings.items():
        print(f"| {name} | {statistics.median(prefill):.3f} | {statistics.median(steps) * 1000:.1f} "
              f"| {on_grid[name]:.1%} |")
    base, new = (timings[n] for n in ("bfloat16 projection", "float32 projection"))
    prefill_ratio, step_ratio = (statistics.median(new[i]) / statistics.median(base[i]) for i in (0, 1))
    print(f"ratios float32 / bfloat16 projection: prefill {prefill_ratio:.2f}×, step {step_ratio:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
