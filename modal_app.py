"""openjev on Modal: each replica is one B200 container running the whole stack, as `openjev serve
--sglang-python` starts it: a Redis, SGLang, one worker and the API.

    uv run modal run modal_app.py       # ephemeral: start, run `openjev smoke` on it, write smoke-result.json, stop
    uv run modal deploy modal_app.py    # the persistent endpoint

OPENJEV_FRONTEND and OPENJEV_SERVED_MODEL_NAME are forwarded from the shell that runs
`modal`. Other settings go in IMAGE_ENV below, or in Modal Secrets named (comma-separated) by
OPENJEV_MODAL_SECRETS in that shell: for example OPENJEV_API_KEY, HF_TOKEN, or OPENJEV_REDIS_URL, which
makes every replica share one Redis, so async jobs and prefix routing work across replicas.

Redis: by default each replica runs its own (serve's embedded one: loopback, a generated password,
an append-only file) on the container's own disk, not on the Volume: a Volume is shared by every
replica and committed as snapshots, no place for a live append-only file that only one Redis may
write. So a replica's jobs survive its Redis restarting (serve restarts it in place) but not the
container being replaced; jobs that must outlive a container need the shared Redis, which must
require a password (`redis://:PASSWORD@host:port/0`, or rediss://) and persist (AOF, noeviction):
serve refuses a shared URL without a password.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import modal

APP_NAME = "openjev"
GPU = "B200"
SGLANG_VERSION = "0.5.23"
SGLANG_IMAGE = f"lmsysorg/sglang:v{SGLANG_VERSION}-cu130-runtime"  # CUDA 13: Modal's hosts run driver 580
SGLANG_PYTHON = "/usr/bin/python3"  # the image's interpreter, where SGLang is installed
OPENJEV_VENV = "/opt/openjev"  # openjev gets its own environment: SGLang pins its own transformers
OPENJEV_SOURCE = "/root/openjev-src"
OPENJEV_PACKAGES = ("api", "common", "worker", "openjev")
SGLANG_ARGS: tuple[str, ...] = ()  # extra SGLang flags, e.g. ("--mem-fraction-static", "0.85")
API_PORT = 8000
VOLUME_NAME = "openjev-huggingface"
CACHE_MOUNT = "/cache"
REDIS_DIR = "/var/lib/openjev/redis"  # the container's disk: one replica's own Redis (see the module docstring)

MINUTES = 60
STARTUP_TIMEOUT = 40 * MINUTES  # the first start downloads the weights, then loads them and captures graphs
REQUEST_TIMEOUT = 10 * MINUTES  # above the API's own deadlines (120 s per request, 30 s per job poll)
SCALEDOWN_WINDOW = 5 * MINUTES  # scale to zero after five idle minutes
MIN_CONTAINERS = 0  # 1 keeps a replica warm (billed while idle) so no client ever waits for a cold start
MAX_INPUTS = 1000  # requests one replica accepts at once; the API queues them and sheds with 529 itself
TARGET_INPUTS = 64  # Modal adds a replica past this: four times the jobs one worker runs at once

FORWARDED_ENV = ("OPENJEV_FRONTEND", "OPENJEV_SERVED_MODEL_NAME")
SECRETS_ENV = "OPENJEV_MODAL_SECRETS"
IMAGE_ENV = {
    # Weights and every compile cache live on the Volume, so a new replica skips the download and the JIT work.
    "HF_HOME": f"{CACHE_MOUNT}/huggingface",
    "SGLANG_CACHE_DIR": f"{CACHE_MOUNT}/sglang",
    "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/sglang/triton",
    "OPENJEV_CACHE_DIR": f"{CACHE_MOUNT}/openjev",
    "OPENJEV_REDIS_DIR": REDIS_DIR,
    # The workers turn on the sgl-project/sglang#34719 workaround from this.
    "OPENJEV_SGLANG_VERSION": SGLANG_VERSION,
}
ROOT = Path(__file__).resolve().parent


def openjev_image() -> modal.Image:
    """The pinned SGLang image with openjev installed beside it in its own virtual environment."""
    image = modal.Image.from_registry(
        SGLANG_IMAGE, setup_dockerfile_commands=["RUN ln -sf /usr/bin/python3 /usr/bin/python"]).entrypoint([])
    for name in ("pyproject.toml", "README.md"):
        image = image.add_local_file(ROOT / name, f"{OPENJEV_SOURCE}/{name}", copy=True)
    for package in OPENJEV_PACKAGES:
        image = image.add_local_dir(ROOT / package, f"{OPENJEV_SOURCE}/{package}", copy=True,
                                    ignore=["**/__pycache__", "**/*.pyc"])
    return image.run_commands(
        f"python3 -m venv --without-pip {OPENJEV_VENV}",
        f"python3 -m pip --python {OPENJEV_VENV}/bin/python install --no-cache-dir {OPENJEV_SOURCE}",
    ).env(IMAGE_ENV)


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The settings taken from the deploying shell: those of FORWARDED_ENV that are set there."""
    return {name: env[name] for name in FORWARDED_ENV if env.get(name)}


def deployment_secrets(env: Mapping[str, str]) -> list[modal.Secret]:
    """The Modal Secrets named in OPENJEV_MODAL_SECRETS; none by default, so a first deploy needs none."""
    names = [name.strip() for name in env.get(SECRETS_ENV, "").split(",") if name.strip()]
    return [modal.Secret.from_name(name) for name in names]


def serve_command(env: Mapping[str, str]) -> list[str]:
    """The supervisor the container runs: `openjev serve` launching SGLang, on the port Modal routes to."""
    argv = [f"{OPENJEV_VENV}/bin/openjev", "serve", "--host", "0.0.0.0", "--port", str(API_PORT),
            "--sglang-python", SGLANG_PYTHON]
    if env.get("OPENJEV_REDIS_URL"):
        argv.append("--shared-redis")  # replicas share that Redis instead of each starting its own
    return argv + (["--", *SGLANG_ARGS] if SGLANG_ARGS else [])


def exit_with(process: subprocess.Popen[bytes], end: Callable[[int], object] = os._exit) -> None:
    """Wait for `process`, then end the container with its status, so Modal replaces a broken replica."""
    end(exit_status(process.wait()))


def exit_status(returncode: int) -> int:
    """A process's return code as a shell reports it (a signal N becomes 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


app = modal.App(APP_NAME)
hf_volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)


@app.function(image=openjev_image(), gpu=GPU, volumes={CACHE_MOUNT: hf_volume}, env=forwarded_env(os.environ),
              secrets=deployment_secrets(os.environ), timeout=REQUEST_TIMEOUT, startup_timeout=STARTUP_TIMEOUT,
              scaledown_window=SCALEDOWN_WINDOW, min_containers=MIN_CONTAINERS)
@modal.concurrent(max_inputs=MAX_INPUTS, target_inputs=TARGET_INPUTS)
@modal.web_server(API_PORT, startup_timeout=STARTUP_TIMEOUT)
def serve() -> None:
    """Start the stack; Modal routes HTTP to the API port once it is open (the API answers 503 until ready)."""
    process = subprocess.Popen(serve_command(os.environ))
    threading.Thread(target=exit_with, args=(process,), daemon=True).start()


@app.local_entrypoint()
def main(allow_weak_model: bool = False, out: str = "smoke-result.json") -> None:
    """`modal run modal_app.py`: smoke-test the ephemeral server; the app stops when this returns."""
    from openjev.smoke import run_smoke

    key_env = "OPENJEV_API_KEY" if os.environ.get("OPENJEV_API_KEY") else None
    code = run_smoke(serve.get_web_url(), key_env=key_env, allow_weak_model=allow_weak_model, out=out,
                     startup_timeout=STARTUP_TIMEOUT)
    if code:
        sys.exit(code)
