"""compose.yaml's `cpu` profile brought up for real: Redis, the CPU engine, a worker and the API in
their containers, answering the README example as the local CPU stack does. Needs a Docker daemon
that holds the profile's images (`bash .ci/with-docker.sh bash .ci/compose-images.sh` builds them
where no registry is reachable) and a compose CLI; skipped otherwise."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from docker.errors import ImageNotFound
from testcontainers.core.docker_client import DockerClient

from harness.processes import ROOT
from harness.redis_servers import docker_answers
from harness.stacks import Stack
from harness.web import web
from openjev.embedded_redis import free_port

PROFILE_IMAGES = ("openjev:0.1.0", "openjev-cpu-engine:0.1.0")
# Where no registry is reachable, .ci/compose-images.sh builds this in place of compose's redis image.
REDIS_STAND_IN = "openjev-ci/compose-redis:7"
PROJECT = f"openjev-test-{os.getpid()}"
EXAMPLE = orjson.loads((ROOT / "examples" / "request.json").read_bytes())
UP_TIMEOUT = 900.0  # the engine converts the bundled model on its first start, then the worker waits for it
NUMERIC_FIELDS = {"noul", "score", "probabilities", "confidence"}

# `up` waits for the engine's health, which waits for the model's conversion (~3 min on a busy machine).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(UP_TIMEOUT + 900)]


def compose_cli() -> list[str] | None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    return [found] if found else None


def has_image(name: str) -> bool:
    try:
        DockerClient().client.images.get(name)
    except ImageNotFound:
        return False
    return True


def skip_reason() -> str | None:
    if not docker_answers():
        return "no Docker daemon"
    if not compose_cli():
        return "no compose CLI"
    missing = [name for name in PROFILE_IMAGES if not has_image(name)]
    return f"the daemon lacks {', '.join(missing)}" if missing else None


@pytest.fixture(scope="module")
def compose_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cli = compose_cli()
    assert cli
    files = ["-f", str(ROOT / "compose.yaml")]
    if has_image(REDIS_STAND_IN):
        override = tmp_path_factory.mktemp("compose") / "redis-image.yaml"
        override.write_text(f"services:\n  redis:\n    image: {REDIS_STAND_IN}\n")
        files += ["-f", str(override)]
    port = free_port()
    base = [*cli, "--profile", "cpu", "-p", PROJECT, *files]
    env = {**os.environ, "OPENJEV_API_PORTS": str(port), "OPENJEV_REDIS_PASSWORD": secrets.token_hex(16)}
    try:
        up = [*base, "up", "-d", "--no-build"]
        if subprocess.run(up, env=env, cwd=ROOT, timeout=UP_TIMEOUT).returncode != 0:
            # The engine's first start (the model's conversion) can outlast its health start period on
            # a busy machine; compose then gives up on its dependants although the engine recovers.
            wait_engine_healthy()
            subprocess.run(up, env=env, check=True, cwd=ROOT, timeout=UP_TIMEOUT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, base, env)
        yield url
    finally:
        subprocess.run([*base, "down", "-v", "--remove-orphans"], env=env, cwd=ROOT, timeout=300)


def wait_engine_healthy() -> None:
    client = DockerClient().client
    deadline = time.monotonic() + UP_TIMEOUT
    label = {"label": [f"com.docker.compose.project={PROJECT}", "com.docker.compose.service=cpu-engine"]}
    while time.monotonic() < deadline:
        engines = client.containers.list(filters=label)
        if engines and engines[0].attrs["State"].get("Health", {}).get("Status") == "healthy":
            return
        time.sleep(5)
    raise AssertionError(f"the cpu engine was not healthy within {UP_TIMEOUT:g} s")


def wait_healthy(url: str, base: list[str], env: dict[str, str]) -> None:
    """Until the API's /health is 200: Redis, the engine and a live worker behind it."""
    deadline = time.monotonic() + UP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if web.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    logs = subprocess.run([*base, "logs", "--no-color", "--tail", "40"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout
    raise AssertionError(f"the cpu profile was not healthy within {UP_TIMEOUT:g} s:\n{logs}")


def test_the_cpu_profile_answers_the_readme_example_as_the_local_stack_does(compose_api: str,
                                                                             cpu_stack: Stack) -> None:
    response = web.post(f"{compose_api}/v1/systemone", json=EXAMPLE, timeout=300)
    assert response.status_code == 200, response.text
    answers = response.json()["answers"]
    assert set(answers) == set(EXAMPLE["questions"])
    local = cpu_stack.post(EXAMPLE, timeout=300)
    assert local.status_code == 200, local.text
    for name, answer in local.json()["answers"].items():
        expected = figures(answer)
        assert expected, answer
        assert figures(answers[name]) == pytest.approx(expected, abs=1e-4), name


def figures(answer: dict[str, Any]) -> dict[str, float]:
    """An answer's numbers, one level deep (`probabilities.Billing`), as pytest.approx compares them."""
    flat: dict[str, float] = {}
    for key in NUMERIC_FIELDS & answer.keys():
        value = answer[key]
        flat.update({f"{key}.{label}": p for label, p in value.items()} if isinstance(value, dict) else {key: value})
    return flat


def test_the_profile_uses_the_images_it_was_given(compose_api: str) -> None:
    client = DockerClient().client
    running = {c.labels["com.docker.compose.service"]: c.image.tags
               for c in client.containers.list(filters={"label": f"com.docker.compose.project={PROJECT}"})}
    assert {"redis", "cpu-engine", "worker-cpu", "api-cpu"} <= set(running)
    assert "openjev-cpu-engine:0.1.0" in running["cpu-engine"]
    assert "openjev:0.1.0" in running["api-cpu"] and "openjev:0.1.0" in running["worker-cpu"]
