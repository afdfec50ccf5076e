#!/usr/bin/env bash
# Installs a real SGLang 0.5.23 for a CPU without a GPU (no CUDA, no sgl-kernel) into a virtual
# environment, for the `sglang` test tier and for trying `openjev serve --sglang-python` on a laptop.
#
#   deploy/install_sglang_cpu.sh [VENV]        (default VENV: .cache/sglang-venv)
#
# Needs a local wheel folder holding the CPU build of torch 2.13.0 (UV_FIND_LINKS or PIP_FIND_LINKS):
# PyPI's torch is the multi-GB CUDA build. Idempotent: an environment that finished installing is
# left as it is. Then launch it the way production does, with the launcher's CPU flags:
#
#   OPENJEV_SGLANG_DEVICE=cpu uv run --extra cpu openjev serve --sglang-python .cache/sglang-venv/bin/python
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0+cpu

VENV=$(realpath -m "${1:-.cache/sglang-venv}")
RECIPE=2  # bump when this script changes what it installs: an environment of an older recipe is rebuilt
DONE="$VENV/.openjev-sglang-$SGLANG_VERSION-r$RECIPE"

# Reads the installed version's metadata only: importing sglang would load torch (slow).
if [ -f "$DONE" ] && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'" 2>/dev/null; then
    echo "SGLang $SGLANG_VERSION already installed in $VENV" >&2
    exit 0
fi

WHEELS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}
if [ -z "$WHEELS" ]; then
    echo "set UV_FIND_LINKS (or PIP_FIND_LINKS) to a folder holding torch-$TORCH_VERSION's wheel" >&2
    exit 2
fi

started=$(date +%s)
rm -rf "$VENV"
# --no-config: this environment is not the project's; run from the repo, uv would otherwise apply
# pyproject.toml's [tool.uv] overrides (which drop `datasets`, and with it sglang's `dill`).
uv venv -q --no-config -p 3.11 "$VENV"
export VIRTUAL_ENV="$VENV"

# 1. CPU torch and sglang itself, without sglang's CUDA pins.
uv pip install -q --no-config --find-links "$WHEELS" "torch==$TORCH_VERSION" "sglang==$SGLANG_VERSION" --no-deps

# 2. sglang's runtime dependencies less the CUDA-only ones (flashinfer, cutlass-dsl, deep-gemm/ep,
#    flash-mla, sglang-kernel, flash-attn-4, quack, tilelang, humming, nvshmem, cuda-python,
#    torch_memory_saver, torchaudio, torchcodec, smg-grpc). torch is named again so nothing replaces it.
uv pip install -q --no-config --find-links "$WHEELS" "torch==$TORCH_VERSION" \
    aiohttp 'anthropic>=0.20.0' blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict einops \
    fastapi gguf interegular IPython 'llguidance>=1.7.6,<2' msgspec ninja numba==0.65.1 numpy nvidia-ml-py \
    openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow \
    'prometheus-client>=0.20.0' psutil py-spy pybase64 pydantic 'python-dateutil<3' python-multipart \
    'pyzmq>=25.1.2' regex requests scipy sentencepiece==0.2.1 setproctitle soundfile==0.13.1 tiktoken \
    timm==1.0.25 tokenizers==0.23.2 tqdm transformers==5.19.0 'uvicorn>=0.51' uvloop watchfiles \
    xgrammar==0.2.7 xxhash zstandard 'mistral_common>=1.11.5' modelscope huggingface_hub

# 3. timm pulls PyPI's torchvision, a CUDA build whose C++ ops cannot load beside CPU torch, and
#    sglang imports torchvision.transforms unconditionally: register the ops' Python side only when
#    the ops exist.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" - "$SITE/torchvision/__init__.py" <<'PY'
import os
import sys

path = sys.argv[1]
source = open(path).read()
if "if extension._has_ops():" not in source:
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    new = ("if extension._has_ops():\n    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
           "from torchvision import (\n")
    if old not in source:
        sys.exit(f"{path} changed upstream: patch it by hand")
    # uv installs by hard link from its cache: write a new file rather than the shared one in place.
    open(path + ".new", "w").write(source.replace(old, new))
    os.replace(path + ".new", path)
PY

# 4. A stand-in sgl_kernel, in this environment only: SGLANG_USE_CPU_ENGINE=1 imports it at module
#    import, but on a CPU without AMX every op is gated off in favour of native torch; an op that is
#    called anyway raises, so it shows.
mkdir -p "$SITE/sgl_kernel"
cat > "$SITE/sgl_kernel/__init__.py" <<'PY'
"""Stand-in for sgl_kernel on a CPU without AMX: importable, and any op called on it raises."""

__version__ = "0.0.0+openjev-stub"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} was called")

    return op
PY

"$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'"
# What the launch imports first (server arguments and model configs): a missing dependency shows here.
"$VENV/bin/python" -c "import sglang.srt.arg_groups.pipeline"
touch "$DONE"
echo "SGLang $SGLANG_VERSION installed in $VENV in $(( $(date +%s) - started )) s ($(du -sh "$VENV" | cut -f1))" >&2
