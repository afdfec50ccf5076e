"""What reading a bfloat16 CPU model's logits off bfloat16's grid costs (worker/cpu_engine/head.py): the
same loaded model with three output projections swapped in turn, in one process, the order flipping every
round: the bfloat16 original, the engine's `RefinedHead` (the original, its 64 largest logits per position
recomputed in float32) and a float32 copy of the whole projection. Times a ~250-token prefill from nothing,
an 8-token step after it and a packed call of three 8-token branches after it (a batched branch call's
shape), and says what share of the step's 64 largest logits sit on bfloat16's grid.

    uv run --extra cpu --extra dev [--extra qwen] python -m bench.cpu_head [--model qwen2.5-1.5b] [--rounds 6]

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
from worker.cpu_engine.packing import forward_packed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a catalog model (default {DEFAULT_MODEL})")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    import torch

    class Float32Projection(torch.nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(hidden.float(), self.weight)

    model_dir, served_name = resolve_model(args.model, Settings().cache_dir / "models")
    loaded = load_model(model_dir, served_name, dtype="bfloat16")  # with its RefinedHead
    refined = loaded.model.get_output_embeddings()
    heads = {"bfloat16 (before)": refined.head, "refined (the engine's)": refined,
             "float32 copy": Float32Projection(refined.weight)}
    prompt = loaded.tokenizer(" ".join([EXAMPLE_REQUEST["state"]] * 12)).input_ids[:250]
    step = loaded.tokenizer(" Which team should handle this? Answer:").input_ids[:8]
    tails = [step, step[::-1], step[1:] + step[:1]]
    timings: dict[str, list[list[float]]] = {name: [[], [], []] for name in heads}
    on_grid: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, head in list(heads.items())[::1 if round_ % 2 else -1]:
            loaded.model.set_output_embeddings(head)
            started = time.perf_counter()
            _, kv = loaded.forward(prompt, None)
            prefilled = time.perf_counter()
            logits, _ = loaded.forward(step, kv)
            stepped = time.perf_counter()
            forward_packed(loaded, kv, len(prompt), [], tails)
            packed = time.perf_counter()
            for column, seconds in zip(timings[name], (prefilled - started, stepped - prefilled, packed - stepped),
                                       strict=True):
                column.append(seconds)
            top = logits.topk(64).values
            on_grid[name] = (top.bfloat16().float() == top).float().mean().item()
    loaded.model.set_output_embeddings(refined)
    print(f"{args.model} in bfloat16, {torch.get_num_threads()} threads, {args.rounds} rounds; the float32 copy "
          f"of the projection would hold {refined.weight.numel() * 4 / 2**20:.0f} MiB")
    print("| projection | prefill 250 tokens, s | 8-token step, ms | 3 packed 8-token branches, ms "
          "| top-64 logits on bfloat16's grid |")
    print("|---|---|---|---|---|")
    base = [statistics.median(column) for column in timings["bfloat16 (before)"]]
    for name, columns in timings.items():
        prefill, one, three = (statistics.median(column) for column in columns)
        print(f"| {name} | {prefill:.3f} ({prefill / base[0]:.2f}×) | {one * 1000:.1f} ({one / base[1]:.2f}×) "
              f"| {three * 1000:.1f} ({three / base[2]:.2f}×) | {on_grid[name]:.0%} |")
    print("medians of the rounds; ratios against the bfloat16 projection")
    return 0


if __name__ == "__main__":
    sys.exit(main())
