"""compose.yaml and its images: the file validates, and it keeps the deployment's invariants (a GPU per
SGLang server, long health start, private engines, workers after their engine, the launcher's command)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from common.settings import Frontend, Settings
from tests.processes import ROOT
from worker.cpu_engine.model import default_tokenizer_dir
from worker.sglang_launcher import sglang_command

COMPOSE_FILE = ROOT / "compose.yaml"
GPU_PAIRS = re.compile(r"(sglang|worker)-(\d+)")
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, Any]:
    return compose()["services"]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default} and $$ for a literal $."""
    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        value = env.get(match.group(1) or match.group(3) or "")
        return match.group(2) if match.group(2) is not None and not value else value or ""

    return VARIABLE.sub(substitute, text)


def container_env(service: dict[str, Any], shell: dict[str, str]) -> dict[str, str]:
    """The environment compose gives `service`; a key without a value passes the shell's, if set."""
    env = {}
    for name, value in service.get("environment", {}).items():
        if value is None:
            if name in shell:
                env[name] = shell[name]
        else:
            env[name] = interpolate(str(value), shell)
    return env


def seconds(duration: str) -> int:
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in re.findall(r"(\d+)([hms])", duration))


def gpu_pairs(all_services: dict[str, Any]) -> list[int]:
    return sorted({int(m.group(2)) for name in all_services if (m := GPU_PAIRS.fullmatch(name))})


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_gpus", ROOT / "deploy" / "compose_gpus.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_cli() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.skip("neither docker-compose nor the docker compose plugin is installed (apt-get install docker-compose)")


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_file_validates(profile: str) -> None:
    done = subprocess.run([*compose_cli(), "--profile", profile, "config", "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_generated_gpu_override_validates_with_the_base_file(tmp_path: Path) -> None:
    override = tmp_path / "compose.gpus.yaml"
    override.write_text(load_generator().render(COMPOSE_FILE, 3))
    done = subprocess.run([*compose_cli(), "-f", str(COMPOSE_FILE), "-f", str(override), "--profile", "gpu",
                           "config", "--services"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert {"sglang-0", "sglang-1", "sglang-2", "worker-0", "worker-1", "worker-2"} <= set(done.stdout.split())


def test_services_are_redis_the_api_and_a_pair_per_gpu_plus_the_cpu_profile() -> None:
    assert set(services()) == {"redis", "api", "sglang-0", "worker-0", "cpu-engine", "worker-cpu", "api-cpu"}
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services().items()}
    assert profiles["redis"] == ()  # both profiles use it
    assert {profiles[n] for n in ("api", "sglang-0", "worker-0")} == {("gpu",)}
    assert {profiles[n] for n in ("cpu-engine", "worker-cpu", "api-cpu")} == {("cpu",)}


def test_each_sglang_server_reserves_its_own_gpu_by_device_id() -> None:
    all_services = services() | load_generator().gpus_override(compose(), 4)["services"]
    assert gpu_pairs(all_services) == [0, 1, 2, 3]
    for gpu in gpu_pairs(all_services):
        devices = all_services[f"sglang-{gpu}"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}]


def test_sglang_servers_share_the_hf_cache_volume_and_host_ipc() -> None:
    all_services = services() | load_generator().gpus_override(compose(), 2)["services"]
    for gpu in gpu_pairs(all_services):
        sglang = all_services[f"sglang-{gpu}"]
        assert sglang["ipc"] == "host"
        assert "huggingface:/root/.cache/huggingface" in sglang["volumes"]
        assert container_env(sglang, {})["HF_HOME"] == "/root/.cache/huggingface"
    assert "huggingface" in compose()["volumes"]


def test_sglang_health_allows_for_model_load_and_graph_capture() -> None:
    health = services()["sglang-0"]["healthcheck"]
    assert seconds(health["start_period"]) >= 20 * 60
    assert "/health" in " ".join(health["test"])


def test_engines_redis_and_workers_stay_on_the_private_network() -> None:
    published = {name for name, s in services().items() if s.get("ports")}
    assert published == {"api", "api-cpu"}
    assert services()["sglang-0"]["expose"] == ["30000"]


def test_workers_start_after_their_engine_is_healthy() -> None:
    all_services = services() | load_generator().gpus_override(compose(), 3)["services"]
    worker_ids = set()
    for gpu in gpu_pairs(all_services):
        worker = all_services[f"worker-{gpu}"]
        assert worker["depends_on"][f"sglang-{gpu}"] == {"condition": "service_healthy"}
        assert worker["depends_on"]["redis"] == {"condition": "service_healthy"}
        env = container_env(worker, {})
        assert env["OPENJEV_ENGINE_URL"] == f"http://sglang-{gpu}:30000"
        worker_ids.add(env["OPENJEV_WORKER_ID"])
    assert len(worker_ids) == 3
    assert services()["worker-cpu"]["depends_on"]["cpu-engine"] == {"condition": "service_healthy"}


def test_the_api_runs_one_or_more_replicas() -> None:
    api = services()["api"]
    assert interpolate(str(api["deploy"]["replicas"]), {}) == "1"
    assert interpolate(str(api["deploy"]["replicas"]), {"OPENJEV_API_REPLICAS": "3"}) == "3"
    assert interpolate(api["ports"][0], {"OPENJEV_API_PORTS": "8000-8002"}) == "8000-8002:8000"


def test_the_sglang_image_is_pinned_and_its_version_reaches_the_workers() -> None:
    image = interpolate(services()["sglang-0"]["image"], {})
    assert image == "lmsysorg/sglang:v0.5.23-cu130-runtime"
    assert interpolate(services()["sglang-0"]["image"], {"OPENJEV_SGLANG_VERSION": "0.5.19",
                                                          "SGLANG_IMAGE_VARIANT": "cu129"}) == \
        "lmsysorg/sglang:v0.5.19-cu129"
    assert container_env(services()["worker-0"], {})["OPENJEV_SGLANG_VERSION"] == "0.5.23"
    assert container_env(services()["worker-0"], {"OPENJEV_SGLANG_VERSION": "0.5.19"})["OPENJEV_SGLANG_VERSION"] \
        == "0.5.19"


def test_compose_defaults_are_the_settings_defaults() -> None:
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    for name in ("sglang-0", "worker-0", "api"):
        env = container_env(services()[name], {})
        assert env["OPENJEV_MODEL"] == defaults.model
        assert env["OPENJEV_SERVED_MODEL_NAME"] == defaults.served_model_name
        assert env["OPENJEV_MAX_INPUT_TOKENS"] == str(defaults.max_input_tokens)
        assert env["OPENJEV_FRONTEND"] == defaults.frontend.value
        assert "OPENJEV_REVISION" not in env  # unset unless the shell sets it: never an empty pin


PARITY_CASES = {
    "defaults": {},
    "everything set": {"OPENJEV_MODEL": "org/other-model", "OPENJEV_SERVED_MODEL_NAME": "Other Model",
                       "OPENJEV_REVISION": "0123abcd", "OPENJEV_MAX_INPUT_TOKENS": "16384",
                       "OPENJEV_FRONTEND": "python", "OPENJEV_BACKEND_API_KEY": "s3 cret",
                       "SGLANG_EXTRA_ARGS": "--mem-fraction-static 0.8 --cuda-graph-max-bs-decode=32"},
}


@pytest.mark.parametrize("shell", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_sglang_command_in_compose_is_the_launchers(shell: dict[str, str], tmp_path: Path) -> None:
    sglang = services()["sglang-0"]
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho "SGLANG_RUST_SERVER=${SGLANG_RUST_SERVER:-unset}"\n')
    fake.chmod(0o755)
    script = interpolate(sglang["entrypoint"][2], shell)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", **container_env(sglang, shell)}
    printed = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=10,
                             check=True).stdout.splitlines()

    settings = Settings(_env_file=None, **{  # type: ignore[call-arg]
        name.removeprefix("OPENJEV_").lower(): value for name, value in env.items() if name.startswith("OPENJEV_")})
    argv, launcher_env = sglang_command(settings, python="python3", host="0.0.0.0", port=30000,
                                        extra_args=shlex.split(shell.get("SGLANG_EXTRA_ARGS", "")), base_env={})
    assert printed[:-1] == argv[1:]
    assert printed[-1] == f"SGLANG_RUST_SERVER={launcher_env.get('SGLANG_RUST_SERVER', 'unset')}"
    assert (settings.frontend is Frontend.rust) == (printed[-1] == "SGLANG_RUST_SERVER=1")


def test_the_cpu_profile_is_the_same_layout_on_the_reference_engine() -> None:
    cpu = services()
    assert cpu["cpu-engine"]["build"]["dockerfile"] == "deploy/Dockerfile.cpu-engine"
    assert "/health" in " ".join(cpu["cpu-engine"]["healthcheck"]["test"])
    assert container_env(cpu["worker-cpu"], {})["OPENJEV_ENGINE_URL"] == "http://cpu-engine:30000"
    api_env = container_env(cpu["api-cpu"], {})
    models = Path(cpu["cpu-engine"]["command"][cpu["cpu-engine"]["command"].index("--cache-dir") + 1])
    assert api_env["OPENJEV_TOKENIZER"] == str(default_tokenizer_dir(models))
    assert "openjev-cache:/cache/openjev" in cpu["api-cpu"]["volumes"]
    assert "openjev-cache:/cache/openjev" in cpu["cpu-engine"]["volumes"]
    assert cpu["api-cpu"]["depends_on"]["cpu-engine"] == {"condition": "service_healthy"}


def test_api_and_worker_images_have_no_torch_and_no_cuda() -> None:
    lines = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    instructions = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert re.search(r"^FROM python:3\.11-slim$", instructions, re.MULTILINE)
    assert re.search(r"pip install \.(\s|$)", instructions)
    assert "[cpu]" not in instructions and "torch==" not in instructions and "cuda" not in instructions.lower()
    for name in ("api", "worker-0", "worker-cpu", "api-cpu"):
        assert services()[name]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_the_cpu_engine_image_installs_the_cpu_extra_with_cpu_torch() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile.cpu-engine").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert re.search(r'uv pip install --system .*--override \S+ "\.\[cpu\]"', dockerfile)
    assert "whl/cpu" in dockerfile


def test_the_cpu_engine_image_keeps_llama_cpp_out_as_pyproject_does() -> None:
    # pip cannot override dependencies and llama-cpp-python would compile llama.cpp: uv with the same overrides.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    overrides = set(pyproject["tool"]["uv"]["override-dependencies"])
    dockerfile = (ROOT / "deploy" / "Dockerfile.cpu-engine").read_text()
    written = re.search(r"printf '([^']*)' > (\S+)", dockerfile)
    assert written and set(written.group(1).replace('"', "'").split("\\n")[:-1]) == \
        {o.replace('"', "'") for o in overrides}


def test_the_build_context_holds_only_the_package_sources() -> None:
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*"
    allowed = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    for dockerfile in ("Dockerfile", "Dockerfile.cpu-engine"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        copied = {src for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for src in line.split()[:-1]}
        assert copied <= allowed, dockerfile
    assert ".venv" not in allowed and ".git" not in allowed
