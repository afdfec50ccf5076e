"""Stacks of real processes (a Redis, an engine, a worker, an API) for the tests and the benchmarks."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.processes import Proc, start_api, start_scripted_engine, start_worker
from harness.redis_servers import fresh_redis
from harness.web import web

CPU_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Every CPU engine a test starts (child processes inherit this) computes in float32, whatever the host.
# In bfloat16, which `auto` picks on CPUs with bf16 instructions, a packed or cached pass rounds otherwise
# than a plain one, so answers the tests hold equal (batched and one by one, cached and not) differ in the
# third decimal on some CI hosts and not on others. The bfloat16 path has its own test (test_cpu_models.py).
os.environ.setdefault("OPENJEV_CPU_DTYPE", "float32")


def model_cache_dir() -> Path:
    """Converted models are kept across runs (conversion takes ~20 s once per machine)."""
    root = os.environ.get("OPENJEV_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "openjev") / "models"


@dataclass
class Stack:
    """A running openjev: Redis, an engine, worker(s) and an API, all real processes."""

    redis_url: str
    engine: Proc
    api: Proc
    workers: list[Proc]
    env: dict[str, str]
    log_dir: Path
    extra: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.api.url
        return self.api.url

    def post(self, body: Any, path: str = "/v1/systemone", **kwargs: Any) -> httpx.Response:
        return web.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 60), **kwargs)

    def engine_stats(self) -> dict[str, Any]:
        return web.get(f"{self.engine.url}/stats", timeout=5).json()

    def script(self, **settings: Any) -> None:
        web.post(f"{self.engine.url}/script", json=settings, timeout=5).raise_for_status()

    def stop(self) -> None:
        for proc in [self.api, *self.workers, *self.extra, self.engine]:
            proc.stop()


def stack_env(redis_url: str, model_dir: Path, **overrides: str) -> dict[str, str]:
    return {
        "OPENJEV_REDIS_URL": redis_url,
        "OPENJEV_TOKENIZER": str(model_dir),
        "OPENJEV_SERVED_MODEL_NAME": CPU_MODEL_NAME,
        "OPENJEV_CACHE_DIR": str(model_cache_dir().parent),
        **overrides,
    }


def build_stack(redis_url: str, engine: Proc, model_dir: Path, log_dir: Path, **overrides: str) -> Stack:
    env = stack_env(redis_url, model_dir, **overrides)
    assert engine.url
    worker = start_worker(log_dir, env, engine.url, "w0")
    try:
        api = start_api(log_dir, env)
    except BaseException:  # an API that never became ready leaves no worker behind
        worker.stop()
        raise
    return Stack(redis_url, engine, api, [worker], env, log_dir)


@contextmanager
def isolated_scripted_stack(model_dir: Path, log_dir: Path, **overrides: str) -> Iterator[Stack]:
    """A scripted stack on its own Redis, so no other test's worker can take its jobs."""
    with fresh_redis() as redis_url:
        stack = build_stack(redis_url, start_scripted_engine(log_dir), model_dir, log_dir, **overrides)
        try:
            yield stack
        finally:
            stack.stop()


def final_statuses(api_url: str, job_ids: list[str], timeout: float = 180.0,
                   headers: dict[str, str] | None = None) -> list[str]:
    """Each async job's final status, in order (GET ?wait= until it ends, with `headers`: its tenant's key), or
    what stopped the wait: an error's status and type, or "still pending" at `timeout`. A 503 (Redis
    restarting or failing over) must carry Retry-After, and is asked again."""
    deadline = time.monotonic() + timeout

    def final(job_id: str) -> str:
        while time.monotonic() < deadline:
            response = web.get(f"{api_url}/v1/jobs/{job_id}", params={"wait": 10}, headers=headers, timeout=30)
            if response.status_code == 503:
                assert int(response.headers["retry-after"]) >= 1
                time.sleep(0.2)
                continue
            if response.status_code != 200:
                return f"{response.status_code} {response.json()['detail']['error_type']}"
            if response.json()["status"] not in ("queued", "running"):
                return response.json()["status"]
        return "still pending"

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(final, job_ids))


def answered(api_url: str, request: Any, timeout: float = 60.0, path: str = "/v1/systemone") -> httpx.Response:
    """The first answer to a request (sync by default; `path="/v1/jobs"` for an async one) that is not a 503,
    asking again after each 503 (Redis restarting or full, or no worker live yet), which must carry
    Retry-After; the last 503 once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        response = web.post(api_url + path, json=request, timeout=30)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        assert int(response.headers["retry-after"]) >= 1
        time.sleep(0.5)
