"""The tests' Redis servers: a container started by testcontainers whenever a Docker daemon answers,
else the local binary (openjev.embedded_redis). Either way a test gets a URL, with credentials where
the server has them, so no test depends on which one it got.

Tests that kill, stop or restart Redis as a process (tests/test_faults.py) start the local binary
themselves (openjev.embedded_redis.start_redis): they need a server that comes back on the same
port, which a container on a published ephemeral port does not promise, and their subject is the
stack's reaction to the fault, not the server."""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from docker.errors import DockerException
from requests import RequestException
from testcontainers.community.redis import RedisContainer
from testcontainers.core.docker_client import DockerClient

from openjev.embedded_redis import start_redis

# Set by CI (.ci/with-docker.sh): a missing daemon is then an error, not a reason to fall back.
REQUIRE_DOCKER = "OPENJEV_REQUIRE_DOCKER"
# No registry is reachable from CI, so it names the image it imported; elsewhere Docker pulls it.
IMAGE = "OPENJEV_TEST_REDIS_IMAGE"
DEFAULT_IMAGE = "redis:7"
REDIS_PORT = 6379


class DockerRequired(RuntimeError):
    """OPENJEV_REQUIRE_DOCKER=1, but no Docker daemon answers."""


@functools.cache
def docker_answers() -> bool:
    """True when the daemon testcontainers would use answers a ping (asked once per process)."""
    try:
        DockerClient(timeout=10).client.ping()
    except (DockerException, RequestException) as error:
        if os.environ.get(REQUIRE_DOCKER) == "1":
            raise DockerRequired(f"{REQUIRE_DOCKER}=1 but no Docker daemon answers: {error}") from error
        return False
    return True


@contextmanager
def fresh_redis() -> Iterator[str]:
    """A new, empty Redis for a test or a module; yields its URL and removes the server afterwards."""
    if docker_answers():
        with redis_container() as url:
            yield url
    else:
        with local_redis() as (_, url):
            yield url


@contextmanager
def redis_container() -> Iterator[str]:
    """Redis in a container. It has a password: the published port may be reachable from beyond
    loopback on a developer's Docker, and the stack is tested with credentials in its Redis URL."""
    password = secrets.token_urlsafe(16)
    with RedisContainer(os.environ.get(IMAGE, DEFAULT_IMAGE), port=REDIS_PORT, password=password) as container:
        host, port = container.get_container_host_ip(), container.get_exposed_port(REDIS_PORT)
        yield f"redis://:{password}@{host}:{port}/0"


@contextmanager
def local_redis() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The local redis-server as a child process; yields it and its URL."""
    process, url = start_redis()
    try:
        yield process, url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
