"""The tests' Redis servers: in a container when Docker answers, the local binary otherwise, and an
error instead of the fallback when CI requires Docker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from harness.processes import ROOT
from harness.redis_servers import REQUIRE_DOCKER, docker_answers, fresh_redis

NO_DAEMON = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}

# Runs in a child so that its environment decides, not this process's cached answer.
WHICH_SERVER = """
import redis
from harness.redis_servers import fresh_redis
with fresh_redis() as url:
    print(redis.Redis.from_url(url).info("server")["executable"])
"""


def run_child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child_env = {name: value for name, value in os.environ.items() if name != REQUIRE_DOCKER} | env
    return subprocess.run([sys.executable, "-c", WHICH_SERVER], env=child_env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_without_a_daemon_the_local_binary_serves() -> None:
    child = run_child(NO_DAEMON)
    assert child.returncode == 0, child.stderr
    executable = child.stdout.strip()
    assert executable.endswith("redis-server") and executable != "/usr/local/bin/redis-server"


def test_without_a_daemon_required_docker_is_an_error_not_a_fallback() -> None:
    child = run_child({**NO_DAEMON, REQUIRE_DOCKER: "1"})
    assert child.returncode != 0
    assert f"DockerRequired: {REQUIRE_DOCKER}=1 but no Docker daemon answers" in child.stderr


@pytest.mark.skipif(os.environ.get(REQUIRE_DOCKER) != "1" and not docker_answers(), reason="no Docker daemon")
def test_with_a_daemon_redis_runs_in_a_container_behind_a_password() -> None:
    with fresh_redis() as url:
        parsed = redis.connection.parse_url(url)
        assert parsed["password"]
        client = redis.Redis.from_url(url)
        info = client.info("server")
        assert info["process_id"] == 1  # the container's own PID namespace: not a process of this machine
        assert client.set("key", "value") and client.get("key") == b"value"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=parsed["host"], port=parsed["port"]).ping()
    with pytest.raises(redis.ConnectionError):
        client.ping()  # the container is gone
