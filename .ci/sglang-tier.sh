#!/usr/bin/env bash
# The real-SGLang tier (issue 10): installs SGLang 0.5.23's CPU build in .cache/sglang-venv (a fresh
# clone has none: about 2 minutes) and runs the `sglang` marker's tests, which launch it through
# `openjev serve --sglang-python`, once per HTTP frontend. OPENJEV_REQUIRE_SGLANG=1 turns a missing
# interpreter into a failure instead of a skip. Needs UV_FIND_LINKS (or PIP_FIND_LINKS): the folder
# with the CPU build of torch. About 4 GB of RAM while a server runs; one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
# The installer's own find-links only: the project's `uv run` below keeps to uv.lock.
UV_FIND_LINKS="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}" UV_COMPILE_BYTECODE=1 bash deploy/install_sglang_cpu.sh .cache/sglang-venv
export OPENJEV_TEST_SGLANG_PYTHON="$PWD/.cache/sglang-venv/bin/python"
export OPENJEV_REQUIRE_SGLANG=1
uv run --extra cpu --extra dev pytest -m sglang "$@"
