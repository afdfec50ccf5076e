"""What converting a GGUF to safetensors holds in memory: the CPU engine's streamed conversion
(`worker.cpu_engine.model.ensure_converted`: tensor by tensor, one float16 shard per layer) against
transformers' own GGUF loader followed by `save_pretrained` (the whole model dequantized to float32, as
the engine converted before), each in a fresh process of its own, in the same command.

    uv run --extra cpu --extra dev python -m bench.convert_memory                                  # SmolLM2
    uv run --extra cpu --extra dev --extra qwen python -m bench.convert_memory --model qwen2.5-1.5b

Prints each way's peak resident memory (the process's high-water mark: the memory-mapped GGUF's pages
count in it as they are read), its time, and the size of the weights it wrote (float16 streamed, float32
whole), for scale.
Figures: bench/RESULTS-quality.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.stacks import model_cache_dir

# Each child converts into a fresh directory, then prints its peak RSS (KiB on Linux) and its seconds.
CHILD = """
import json, resource, sys, time
from pathlib import Path
way, gguf, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
started = time.perf_counter()
if way == "streamed":
    from worker.cpu_engine.model import ensure_converted
    written = ensure_converted(out, gguf)
else:  # the engine's own whole-model way, still used for architectures it does not stream
    from worker.cpu_engine.model import _write_whole
    written = out / "whole"
    _write_whole(gguf, written)
seconds = time.perf_counter() - started
size = sum(p.stat().st_size for p in written.glob("*.safetensors"))
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": seconds,
                  "weights_bytes": size}))
"""


def gguf_of(model: str | None, cache_dir: Path) -> Path:
    from worker.cpu_engine.model import bundled_gguf_path, catalog_gguf, catalog_model

    return catalog_gguf(catalog_model(model), cache_dir) if model else bundled_gguf_path()


def convert(way: str, gguf: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="openjev-convert-") as out:
        done = subprocess.run([sys.executable, "-c", CHILD, way, str(gguf), out], capture_output=True, text=True,
                              check=False)
    if done.returncode != 0:
        raise SystemExit(f"{way} conversion failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a catalog model (e.g. qwen2.5-1.5b); default: the bundled SmolLM2")
    parser.add_argument("--ways", default="streamed,whole", help="which conversions, in this order")
    args = parser.parse_args()
    gguf = gguf_of(args.model, model_cache_dir())
    print(f"{gguf.name}: {gguf.stat().st_size / 2**20:.0f} MiB GGUF", flush=True)
    lines = ["| conversion | peak RSS | time | weights written |", "|---|---|---|---|"]
    found = {}
    for way in args.ways.split(","):
        found[way] = figures = convert(way, gguf)
        lines.append(f"| {way} | {figures['peak_kib'] / 2**20:.2f} GiB | {figures['seconds']:.0f} s | "
                     f"{figures['weights_bytes'] / 2**30:.2f} GiB |")
        print(lines[-1], flush=True)
    if {"streamed", "whole"} <= found.keys():
        ratio = found["streamed"]["peak_kib"] / found["whole"]["peak_kib"]
        lines.append(f"\npeak RSS streamed / whole: {ratio:.2f}×")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
