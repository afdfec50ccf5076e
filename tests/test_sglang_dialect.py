"""The reference CPU engine speaks SGLang's dialect: its /generate answers, and the requests the worker sends,
decode with SGLang 0.5.23's own JSON contract (`sglang/api/v1/api_types.py` from the published wheel)."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import orjson
import pytest

from harness.processes import spawn
from harness.web import web
from openjev.embedded_redis import free_port
from worker import engine_client

pytestmark = pytest.mark.integration

SGLANG_VERSION = "0.5.23"
WHEEL_CACHE = Path.home() / ".cache" / "openjev" / "sglang-wheel"
CONTRACT_FILE = "sglang/api/v1/api_types.py"
LABELS = [49, 50]  # "A" and "B" in SmolLM2's vocabulary
PROMPT = list(range(1000, 1040))


def sglang_wheel() -> Path:
    """SGLang's wheel, downloaded once per machine. Fixed platform tags, so any host fetches the same file."""
    found = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else ["pip"]
    command = [*pip, "download", "--no-deps", f"sglang=={SGLANG_VERSION}", "-d", str(WHEEL_CACHE),
               "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"could not run pip to download sglang=={SGLANG_VERSION}: {exc!r}")
    found = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        pytest.skip(f"pip download sglang=={SGLANG_VERSION} failed: {result.stderr.strip()[-500:]}")
    return found[0]


@pytest.fixture(scope="module")
def api_types() -> ModuleType:
    """`sglang/api/v1/api_types.py` loaded by path: importing it as a package would run sglang's __init__
    (torch, CUDA); the file itself needs only msgspec."""
    wheel = sglang_wheel()
    target = WHEEL_CACHE / f"api_types-{SGLANG_VERSION}.py"
    if not target.exists():
        target.write_bytes(zipfile.ZipFile(wheel).read(CONTRACT_FILE))
    spec = importlib.util.spec_from_file_location("sglang_api_types", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(model_dir: Path, log_dir: Path) -> Iterator[str]:
    """The engine with a compute delay, so an abort has something to cancel."""
    port = free_port()
    argv = [sys.executable, "-m", "worker.cpu_engine", "--port", str(port), "--cache-dir", str(model_dir.parent),
            "--compute-delay", "1.0"]
    proc = spawn("cpu-engine-dialect", argv, {}, log_dir, health=f"http://127.0.0.1:{port}/health", timeout=600)
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def score_request(input_ids: list[int] | list[list[int]], rid: str | list[str]) -> dict[str, Any]:
    """Byte for byte the body of the worker's branch call (`worker/engine_client.py`)."""
    return {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": -1, "token_ids_logprob": LABELS, "top_logprobs_num": 0,
            "return_text_in_logprobs": False}


def warm_request(input_ids: list[int], rid: str) -> dict[str, Any]:
    """The worker's warm call."""
    return {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return web.post(f"{url}{path}", json=body, timeout=60)


def test_the_worker_requests_decode_as_sglang_generate_requests(api_types: ModuleType) -> None:
    score = api_types.GenerateRequest.from_json_value(score_request(PROMPT, "r1"))
    assert (score.rid, score.input_ids, score.token_ids_logprob, score.logprob_start_len) == \
        ("r1", PROMPT, LABELS, -1)
    assert (score.sampling_params.max_new_tokens, score.sampling_params.temperature) == (1, 0.0)
    warm = api_types.GenerateRequest.from_json_value(warm_request(PROMPT, "w1"))
    assert warm.sampling_params.max_new_tokens == 0
    assert api_types.AbortRequest.from_json_value({"rid": "r1"}).rid == "r1"


def test_the_worker_batched_branch_call_decodes_as_one_sglang_generate_request(api_types: ModuleType) -> None:
    prefix = engine_client.SharedPrefix(PROMPT)
    prompt = engine_client.BranchPrompt
    branches = [prompt("job.b0", [7, 8], LABELS), prompt("job.b1", [9], [*LABELS, 51])]
    batch = api_types.GenerateRequest.from_json_value(orjson.loads(engine_client.score_request(prefix, branches)))
    assert batch.input_ids == [[*PROMPT, 7, 8], [*PROMPT, 9]]
    assert batch.rid == ["job.b0", "job.b1"]  # one rid per branch: each can be aborted on its own
    assert batch.token_ids_logprob == [LABELS, [*LABELS, 51]]  # per prompt, as SGLang's contract allows
    assert (batch.logprob_start_len, batch.sampling_params.max_new_tokens) == (-1, 1)
    same = [prompt("job.b0", [7], LABELS), prompt("job.b1", [8], LABELS)]
    shared = api_types.GenerateRequest.from_json_value(orjson.loads(engine_client.score_request(prefix, same)))
    assert shared.token_ids_logprob == LABELS  # one list for the whole batch, as in the captured probes
    single = api_types.GenerateRequest.from_json_value(orjson.loads(engine_client.score_request(prefix, same[:1])))
    assert (single.rid, single.input_ids, single.token_ids_logprob) == ("job.b0", [*PROMPT, 7], LABELS)


def test_a_single_answer_decodes_as_a_generate_response(api_types: ModuleType, engine: str) -> None:
    response = post(engine, "/generate", score_request(PROMPT, "single"))
    assert response.status_code == 200
    decoded = api_types.GenerateResponse.from_json_value(response.json())
    meta = decoded.meta_info
    assert (meta.id, meta.prompt_tokens, meta.completion_tokens) == ("single", len(PROMPT), 1)
    assert isinstance(meta.finish_reason, api_types.FinishLength) and meta.finish_reason.length == 1
    assert [entry.token_id for entry in meta.output_token_ids_logprobs[0]] == LABELS
    assert all(entry.logprob is not None and entry.logprob <= 0 for entry in meta.output_token_ids_logprobs[0])
    assert decoded.output_ids == [meta.output_token_logprobs[0].token_id]
    assert meta.e2e_latency is not None and meta.e2e_latency > 0


def test_a_warm_answer_decodes_and_the_branch_reports_the_cache(api_types: ModuleType, engine: str) -> None:
    salt = uuid.uuid4().hex
    warm = post(engine, "/generate", warm_request(PROMPT, "warm") | {"cache_salt": salt})
    branch = post(engine, "/generate", score_request([*PROMPT, 2000, 2001], "branch") | {"cache_salt": salt})
    warm_meta = api_types.GenerateResponse.from_json_value(warm.json()).meta_info
    branch_meta = api_types.GenerateResponse.from_json_value(branch.json()).meta_info
    assert (warm_meta.completion_tokens, warm_meta.cached_tokens) == (0, 0)
    assert isinstance(warm_meta.finish_reason, api_types.FinishLength)
    assert branch_meta.cached_tokens == len(PROMPT)


def test_a_batch_answer_decodes_item_by_item(api_types: ModuleType, engine: str) -> None:
    response = post(engine, "/generate", score_request([PROMPT[:10], PROMPT[:20]], "batch"))
    body = response.json()
    assert isinstance(body, list)
    decoded = [api_types.GenerateResponse.from_json_value(item) for item in body]
    assert [(d.meta_info.id, d.meta_info.prompt_tokens) for d in decoded] == [("batch_0", 10), ("batch_1", 20)]


async def test_an_aborted_answer_decodes_with_an_abort_finish_reason(api_types: ModuleType, engine: str) -> None:
    received = web.get(f"{engine}/stats", timeout=10).json()["requests_received"]
    async with httpx.AsyncClient(base_url=engine, timeout=60) as client:
        call = asyncio.create_task(client.post("/generate", json=score_request(PROMPT, "doomed")))
        deadline = time.monotonic() + 30
        while (await client.get("/stats")).json()["requests_received"] == received:  # until "doomed" is live
            assert time.monotonic() < deadline, "the call never reached the engine"
            await asyncio.sleep(0.02)
        abort = await client.post("/abort_request", json={"rid": "doomed"})
        answer = await call
    assert (abort.status_code, abort.content) == (200, b"")
    assert answer.status_code == 200
    meta = api_types.GenerateResponse.from_json_value(answer.json()).meta_info
    assert isinstance(meta.finish_reason, api_types.FinishAbort)
    assert meta.finish_reason.message


def test_unknown_sampling_params_are_refused_by_both(api_types: ModuleType, engine: str) -> None:
    body = score_request(PROMPT, "bad")
    body["sampling_params"] = {"max_new_tokens": 1, "temprature": 0.0}
    with pytest.raises(api_types.JsonContractError, match="temprature"):
        api_types.GenerateRequest.from_json_value(body)
    response = post(engine, "/generate", body)
    assert response.status_code == 400
    error = api_types.ErrorBody.from_json_value(response.json())
    assert error.code == 400 and "temprature" in error.message


def test_model_and_server_info_decode(api_types: ModuleType, engine: str) -> None:
    model_info = api_types.GetModelInfoResponse.from_json_value(web.get(f"{engine}/model_info").json())
    assert model_info.is_generation and model_info.served_model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    server_info = api_types.GetServerInfoResponse.from_json_value(web.get(f"{engine}/server_info").json())
    assert server_info.max_context_length == 8192
