"""The reference CPU engine as the worker sees it: a real subprocess with SmolLM2-135M-Instruct, speaking
SGLang's /generate and /abort_request subset, with a real prefix KV cache."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harness.processes import Proc, spawn
from harness.web import web
from openjev.embedded_redis import free_port
from worker.cpu_engine import model as engine_model
from worker.cpu_engine.prefix_cache import PrefixCache

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
COMPUTE_DELAY = 2.0  # the slow engine's simulated GPU time per prompt


def start_engine(model_dir: Path, log_dir: Path, *args: str) -> Proc:
    """`python -m worker.cpu_engine` on a free port, healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "worker.cpu_engine", "--port", str(port), "--cache-dir", str(model_dir.parent),
            *args]
    proc = spawn("cpu-engine", argv, {}, log_dir, health=f"http://127.0.0.1:{port}/health", timeout=600)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


@pytest.fixture(scope="module")
def engine(model_dir: Path, log_dir: Path) -> Iterator[str]:
    proc = start_engine(model_dir, log_dir)
    yield proc.url or ""
    proc.stop()


@pytest.fixture(scope="module")
def slow_engine(model_dir: Path, log_dir: Path) -> Iterator[str]:
    proc = start_engine(model_dir, log_dir, "--compute-delay", str(COMPUTE_DELAY))
    yield proc.url or ""
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prefix(tokenizer: Any) -> list[int]:
    """A ~300-token chat prefix that ends where the questions' suffixes begin."""
    system = "You judge household decisions carefully and answer with one letter. " * 25
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Question: QMARK"}],
        tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered.split("QMARK")[0])


@pytest.fixture(scope="module")
def labels(tokenizer: Any) -> list[int]:
    ids = [tokenizer.encode(letter) for letter in "AB"]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def suffix(tokenizer: Any, question: str) -> list[int]:
    return tokenizer.encode(f"{question}\nA: yes\nB: no<|im_end|>\n<|im_start|>assistant\nAnswer:")


def score_body(input_ids: list[int], label_ids: list[int], **extra: Any) -> dict[str, Any]:
    """The worker's branch call."""
    return {"input_ids": input_ids, "rid": extra.pop("rid", uuid.uuid4().hex),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": -1, "token_ids_logprob": label_ids, "top_logprobs_num": 0,
            "return_text_in_logprobs": False, **extra}


def warm_body(input_ids: list[int], **extra: Any) -> dict[str, Any]:
    """The worker's warm call."""
    return {"input_ids": input_ids, "rid": uuid.uuid4().hex, "sampling_params": {"max_new_tokens": 0}, **extra}


def generate(url: str, body: dict[str, Any]) -> Any:
    response = web.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def label_logprobs(answer: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_ids_logprobs"][0]]


def stats(url: str) -> dict[str, int]:
    return web.get(f"{url}/stats", timeout=5).json()


def salt() -> str:
    """A fresh prefix-cache namespace, so each test starts cold whatever ran before."""
    return uuid.uuid4().hex


# ---- the prefix cache on its own ----


def kv_of(tokens: list[int]) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Fake two-layer KV whose values are the token ids, so a crop is visible."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return ((t.clone(), t.clone()), (t.clone(), t.clone()))


def test_prefix_cache_returns_a_cropped_copy_of_the_longest_match() -> None:
    cache = PrefixCache(capacity_tokens=100)
    cache.store("s", torch.tensor([1, 2, 3, 4]), kv_of([1, 2, 3, 4]))
    cache.store("s", torch.tensor([1, 2, 9]), kv_of([1, 2, 9]))
    hit = cache.longest_prefix("s", torch.tensor([1, 2, 3, 7, 8]), limit=4)
    assert hit.length == 3
    assert hit.kv is not None
    assert hit.kv[0][0].flatten().tolist() == [1, 2, 3]
    hit.kv[0][0].fill_(-1)
    again = cache.longest_prefix("s", torch.tensor([1, 2, 3, 4, 5]), limit=4)
    assert again.kv is not None and again.kv[0][0].flatten().tolist() == [1, 2, 3, 4]


def test_prefix_cache_leaves_the_limit_and_other_salts_alone() -> None:
    cache = PrefixCache(capacity_tokens=100)
    cache.store("s", torch.tensor([1, 2, 3]), kv_of([1, 2, 3]))
    assert cache.longest_prefix("s", torch.tensor([1, 2, 3]), limit=2).length == 2
    assert cache.longest_prefix("other", torch.tensor([1, 2, 3, 4]), limit=3).length == 0


def test_prefix_cache_evicts_least_recently_used_prompts_beyond_capacity() -> None:
    cache = PrefixCache(capacity_tokens=6)
    cache.store("s", torch.tensor([1, 2, 3]), kv_of([1, 2, 3]))
    cache.store("s", torch.tensor([4, 5, 6]), kv_of([4, 5, 6]))
    assert cache.longest_prefix("s", torch.tensor([1, 2, 3, 0]), limit=3).length == 3  # touches [1, 2, 3]
    cache.store("s", torch.tensor([7, 8]), kv_of([7, 8]))
    assert cache.size_tokens <= 6
    assert cache.longest_prefix("s", torch.tensor([4, 5, 6, 0]), limit=3).length == 0
    assert cache.longest_prefix("s", torch.tensor([1, 2, 3, 0]), limit=3).length == 3


def test_prefix_cache_replaces_an_entry_by_its_extension() -> None:
    cache = PrefixCache(capacity_tokens=100)
    cache.store("s", torch.tensor([1, 2]), kv_of([1, 2]))
    cache.store("s", torch.tensor([1, 2, 3]), kv_of([1, 2, 3]))
    cache.store("s", torch.tensor([1]), kv_of([1]))
    assert (len(cache), cache.size_tokens) == (1, 3)


# ---- conversion ----


def test_conversion_publishes_atomically_and_only_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"")
    calls: list[Path] = []

    def fake_convert(_: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(engine_model, "_convert", fake_convert)
    cache = tmp_path / "models"
    target = engine_model.ensure_converted(cache, gguf)
    assert engine_model.ensure_converted(cache, gguf) == target == cache / "Tiny.Q4"
    assert len(calls) == 1 and calls[0] != target
    assert sorted(p.name for p in cache.iterdir()) == ["Tiny.Q4"]


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"")

    def broken_convert(_: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(engine_model, "_convert", broken_convert)
    with pytest.raises(OSError, match="disk full"):
        engine_model.ensure_converted(tmp_path / "models", gguf)
    assert list((tmp_path / "models").iterdir()) == []


def test_the_api_side_loads_the_converted_tokenizer_without_torch(model_dir: Path,
                                                                          tmp_path: Path) -> None:
    # A site directory with every installed package but torch, as in the API's environment.
    site = Path(httpx.__file__).resolve().parent.parent
    for entry in site.iterdir():
        if not entry.name.startswith(("torch", "functorch")):
            (tmp_path / entry.name).symlink_to(entry)
    script = (
        "import sys\nfrom pathlib import Path\nfrom transformers import AutoTokenizer\n"
        "from worker.cpu_engine import default_tokenizer_dir\n"
        f"assert default_tokenizer_dir(Path({str(model_dir.parent)!r})) == Path({str(model_dir)!r})\n"
        f"tok = AutoTokenizer.from_pretrained({str(model_dir)!r})\n"
        "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
        " add_generation_prompt=True)\n"
        "print('torch' in sys.modules, tok.model_max_length, repr(text))\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", script], env={"PYTHONPATH": f"{tmp_path}:{REPO}"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "False 8192 '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\\n<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'")


# ---- the HTTP engine ----


def test_health_and_model_info_describe_the_served_model(engine: str, model_dir: Path) -> None:
    assert web.get(f"{engine}/health", timeout=5).status_code == 200
    info = web.get(f"{engine}/model_info", timeout=5).json()
    assert info == {"model_path": str(model_dir), "tokenizer_path": str(model_dir), "is_generation": True,
                    "served_model_name": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert web.get(f"{engine}/server_info", timeout=5).json()["max_context_length"] == 8192


def test_label_logprobs_are_full_vocabulary_log_probabilities(engine: str, tokenizer: Any, prefix: list[int],
                                                              labels: list[int]) -> None:
    answer = generate(engine, score_body(prefix + suffix(tokenizer, "Is water wet?"), labels,
                                         top_logprobs_num=5))
    meta = answer["meta_info"]
    values = label_logprobs(answer)
    assert [entry[1] for entry in meta["output_token_ids_logprobs"][0]] == labels
    assert all(math.isfinite(v) and v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1
    top = meta["output_top_logprobs"][0]
    assert top[0][1] == answer["output_ids"][0]  # greedy: the emitted token is the most likely one
    assert [entry[0] for entry in top] == sorted((entry[0] for entry in top), reverse=True)
    top_by_id = {entry[1]: entry[0] for entry in top}
    for token, value in zip(labels, values, strict=True):
        assert top_by_id.get(token, value) == pytest.approx(value) and value <= top[0][0]
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    assert (meta["completion_tokens"], answer["text"]) == (1, tokenizer.decode(answer["output_ids"]))


def test_branches_reuse_the_warm_prefix_and_match_a_cold_computation(engine: str, tokenizer: Any,
                                                                     prefix: list[int], labels: list[int]) -> None:
    questions = [suffix(tokenizer, "Is water wet?"), suffix(tokenizer, "Do cats fly?")]
    assert questions[0][0] != questions[1][0]  # so a branch cannot reuse its sibling beyond the prefix
    cold = [generate(engine, score_body(prefix + q, labels, cache_salt=salt())) for q in questions]
    assert [c["meta_info"]["cached_tokens"] for c in cold] == [0, 0]

    namespace, before = salt(), stats(engine)
    warm = generate(engine, warm_body(prefix, cache_salt=namespace))
    assert (warm["meta_info"]["cached_tokens"], warm["output_ids"]) == (0, [])
    branches = [generate(engine, score_body(prefix + q, labels, cache_salt=namespace)) for q in questions]

    assert [b["meta_info"]["cached_tokens"] for b in branches] == [len(prefix), len(prefix)]
    for branch, reference in zip(branches, cold, strict=True):
        assert label_logprobs(branch) == pytest.approx(label_logprobs(reference), abs=1e-4)
        assert branch["output_ids"] == reference["output_ids"]
    after = stats(engine)
    assert after["cached_tokens"] - before["cached_tokens"] == 2 * len(prefix)
    assert after["forward_passes"] - before["forward_passes"] == 3


def test_cache_salt_and_extra_key_namespace_the_prefix_cache(engine: str, tokenizer: Any, prefix: list[int],
                                                             labels: list[int]) -> None:
    prompt = prefix + suffix(tokenizer, "Is water wet?")
    namespace = salt()
    generate(engine, warm_body(prefix, cache_salt=namespace))
    assert generate(engine, score_body(prompt, labels, cache_salt=salt()))["meta_info"]["cached_tokens"] == 0
    assert generate(engine, score_body(prompt, labels, cache_salt=namespace,
                                       extra_key="k"))["meta_info"]["cached_tokens"] == 0
    assert generate(engine, score_body(prompt, labels, cache_salt=namespace))["meta_info"]["cached_tokens"] \
        == len(prefix)


def test_a_logprob_start_len_caps_the_prefix_match_as_in_sglang(engine: str, tokenizer: Any, prefix: list[int],
                                                                labels: list[int]) -> None:
    namespace = salt()
    generate(engine, warm_body(prefix, cache_salt=namespace))
    answer = generate(engine, score_body(prefix + suffix(tokenizer, "Is water wet?"), labels, cache_salt=namespace,
                                         logprob_start_len=10))
    assert answer["meta_info"]["cached_tokens"] == 10


def test_temperature_scales_logprobs_only_with_a_decode_step(engine: str, tokenizer: Any, prefix: list[int],
                                                             labels: list[int]) -> None:
    prompt = prefix + suffix(tokenizer, "Is water wet?")
    unscaled = label_logprobs(generate(engine, score_body(prompt, labels)))
    prefill_only = generate(engine, score_body(prompt, labels, sampling_params={"max_new_tokens": 0,
                                                                                "temperature": 2.0}))
    decoded = generate(engine, score_body(prompt, labels, sampling_params={"max_new_tokens": 1,
                                                                           "temperature": 2.0}))
    assert (prefill_only["output_ids"], prefill_only["meta_info"]["completion_tokens"]) == ([], 0)
    assert label_logprobs(prefill_only) == pytest.approx(unscaled, abs=1e-4)
    scaled = label_logprobs(decoded)
    assert scaled != pytest.approx(unscaled, abs=1e-3)
    # log_softmax(logits / T): gaps between labels shrink by exactly T.
    assert scaled[0] - scaled[1] == pytest.approx((unscaled[0] - unscaled[1]) / 2.0, abs=1e-4)


def test_a_batch_answers_in_order_with_indexed_rids(engine: str, tokenizer: Any, prefix: list[int],
                                                    labels: list[int]) -> None:
    prompts = [prefix[:50], prefix[:60], prefix[:70]]
    answers = generate(engine, score_body(prompts, labels, rid="batch"))
    assert [a["meta_info"]["id"] for a in answers] == ["batch_0", "batch_1", "batch_2"]
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [50, 60, 70]
    named = generate(engine, score_body(prompts[:2], labels, rid=["x", "y"]))
    assert [a["meta_info"]["id"] for a in named] == ["x", "y"]


def test_a_batch_is_computed_in_one_pass_and_matches_its_prompts_one_by_one(engine: str, tokenizer: Any,
                                                                          prefix: list[int],
                                                                          labels: list[int]) -> None:
    questions = [suffix(tokenizer, q) for q in ("Is water wet?", "Do cats fly?", "Is ice cold?")]
    label_sets = [labels, [*labels, tokenizer.encode("C")[0]], labels[::-1]]  # per prompt, as the worker sends
    namespace = salt()
    generate(engine, warm_body(prefix, cache_salt=namespace))
    before = stats(engine)
    batch = generate(engine, score_body([prefix + q for q in questions], label_sets, rid=["x", "y", "z"],
                                        cache_salt=namespace))
    after = stats(engine)
    assert after["forward_passes"] - before["forward_passes"] == 1
    assert [a["meta_info"]["id"] for a in batch] == ["x", "y", "z"]
    assert [a["meta_info"]["cached_tokens"] for a in batch] == [len(prefix)] * 3
    one_by_one = [generate(engine, score_body(prefix + q, ids, cache_salt=salt()))
                  for q, ids in zip(questions, label_sets, strict=True)]
    for answer, reference, ids in zip(batch, one_by_one, label_sets, strict=True):
        assert [e[1] for e in answer["meta_info"]["output_token_ids_logprobs"][0]] == ids
        assert label_logprobs(answer) == pytest.approx(label_logprobs(reference), abs=1e-4)
        assert answer["output_ids"] == reference["output_ids"]
        assert answer["meta_info"]["prompt_tokens"] == reference["meta_info"]["prompt_tokens"]


def test_a_cold_batch_computes_the_start_its_prompts_share_once(engine: str, tokenizer: Any, prefix: list[int],
                                                               labels: list[int]) -> None:
    questions = [suffix(tokenizer, q) for q in ("Is water wet?", "Do cats fly?")]
    namespace = salt()
    batch = generate(engine, score_body([prefix + q for q in questions], labels, cache_salt=namespace))
    assert [a["meta_info"]["cached_tokens"] for a in batch] == [0, 0]
    # each prompt's whole KV was kept: asked again, only its last token is computed
    again = generate(engine, score_body([prefix + q for q in questions], labels, cache_salt=namespace))
    assert [a["meta_info"]["cached_tokens"] for a in again] == [len(prefix) + len(q) - 1 for q in questions]
    for first, second, q in zip(batch, again, questions, strict=True):
        reference = generate(engine, score_body(prefix + q, labels, cache_salt=salt()))
        assert label_logprobs(first) == pytest.approx(label_logprobs(reference), abs=1e-4)
        assert label_logprobs(second) == pytest.approx(label_logprobs(reference), abs=1e-4)


@pytest.mark.parametrize(("change", "message"), [
    ({"sampling_params": {"max_new_tokens": 1, "top_q": 0.5}}, "top_q"),
    ({"sampling_params": {"max_new_tokens": 2}}, "max_new_tokens"),
    ({"stream": True}, "stream"),
    ({"input_ids": None, "text": "hello"}, "input_ids"),
    ({"input_ids": [1, 10**9]}, "vocabulary"),
    ({"rid": ["a", "b"]}, "rid"),
])
def test_unsupported_requests_are_400_with_sglang_error_body(engine: str, labels: list[int],
                                                             change: dict[str, Any], message: str) -> None:
    body = score_body([1, 2, 3], labels) | change
    response = web.post(f"{engine}/generate", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()
    assert (error["object"], error["type"], error["code"]) == ("error", "BadRequestError", 400)
    assert message in error["message"]


async def admitted(url: str, before: dict[str, int], prompts: int, timeout: float = 30.0) -> None:
    """Until the engine has admitted `prompts` more prompts than at `before` (they then wait out its compute delay)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while stats(url)["requests_received"] - before["requests_received"] < prompts:
        assert loop.time() < deadline, f"{prompts} prompt(s) not admitted within {timeout:g} s"
        await asyncio.sleep(0.02)


async def test_abort_drops_a_queued_request_before_compute(slow_engine: str, prefix: list[int],
                                                          labels: list[int]) -> None:
    before = stats(slow_engine)
    async with httpx.AsyncClient(base_url=slow_engine, timeout=60) as client:
        first = asyncio.create_task(client.post("/generate", json=score_body(prefix, labels, rid="running")))
        queued = asyncio.create_task(client.post("/generate", json=score_body(prefix, labels, rid="queued")))
        await admitted(slow_engine, before, 2)
        assert (await client.post("/abort_request", json={"rid": "queued"})).status_code == 200
        aborted = (await asyncio.wait_for(queued, timeout=1.0)).json()
        finished = (await first).json()
    # a negative check's window: the thread would have computed the dropped request by now
    await asyncio.sleep(COMPUTE_DELAY + 1)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert finished["meta_info"]["finish_reason"]["type"] == "length"
    after = stats(slow_engine)
    assert after["aborts_received"] - before["aborts_received"] == 1
    assert after["requests_aborted"] - before["requests_aborted"] == 1
    assert after["requests_finished"] - before["requests_finished"] == 1
    assert after["forward_passes"] - before["forward_passes"] == 1


async def test_an_aborted_prompt_of_a_batch_leaves_the_others_computed(slow_engine: str, prefix: list[int],
                                                                      labels: list[int]) -> None:
    before = stats(slow_engine)
    prompts = [[*prefix, 50 + i] for i in range(3)]
    async with httpx.AsyncClient(base_url=slow_engine, timeout=60) as client:
        call = asyncio.create_task(client.post("/generate", json=score_body(prompts, labels, rid=["k0", "k1", "k2"])))
        await admitted(slow_engine, before, 3)
        assert (await client.post("/abort_request", json={"rid": "k1"})).status_code == 200
        answers = (await call).json()
    assert [a["meta_info"]["finish_reason"]["type"] for a in answers] == ["length", "abort", "length"]
    after = stats(slow_engine)
    assert after["forward_passes"] - before["forward_passes"] == 1
    assert (after["requests_finished"] - before["requests_finished"],
            after["requests_aborted"] - before["requests_aborted"]) == (2, 1)


async def test_a_batch_aborted_whole_is_never_computed(slow_engine: str, prefix: list[int],
                                                      labels: list[int]) -> None:
    before = stats(slow_engine)
    prompts = [[*prefix, 60 + i] for i in range(2)]
    async with httpx.AsyncClient(base_url=slow_engine, timeout=60) as client:
        call = asyncio.create_task(client.post("/generate", json=score_body(prompts, labels, rid=["g0", "g1"])))
        await admitted(slow_engine, before, 2)
        for rid in ("g0", "g1"):
            await client.post("/abort_request", json={"rid": rid})
        answers = (await asyncio.wait_for(call, timeout=1.0)).json()
    assert [a["meta_info"]["finish_reason"]["type"] for a in answers] == ["abort", "abort"]
    await asyncio.sleep(COMPUTE_DELAY)  # a negative check's window: a forward pass would have come by now
    assert stats(slow_engine)["forward_passes"] == before["forward_passes"]


async def test_abort_stops_a_request_in_progress(slow_engine: str, prefix: list[int], labels: list[int]) -> None:
    before = stats(slow_engine)
    async with httpx.AsyncClient(base_url=slow_engine, timeout=60) as client:
        call = asyncio.create_task(client.post("/generate", json=score_body(prefix, labels, rid="busy")))
        await admitted(slow_engine, before, 1)
        await client.post("/abort_request", json={"rid": "busy"})
        answer = (await asyncio.wait_for(call, timeout=1.0)).json()
        assert (await client.post("/abort_request", json={"rid": "busy"})).status_code == 200  # no longer live
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    await asyncio.sleep(COMPUTE_DELAY)  # a negative check's window: a forward pass would have come by now
    after = stats(slow_engine)
    assert after["forward_passes"] == before["forward_passes"]
    assert (after["aborts_received"] - before["aborts_received"],
            after["requests_aborted"] - before["requests_aborted"]) == (2, 1)


async def test_a_client_that_hangs_up_is_aborted_before_compute(slow_engine: str, prefix: list[int],
                                                                labels: list[int]) -> None:
    before = stats(slow_engine)
    async with httpx.AsyncClient(base_url=slow_engine, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/generate", json=score_body(prefix, labels))
    await asyncio.sleep(COMPUTE_DELAY)  # a negative check's window: a forward pass would have come by now
    after = stats(slow_engine)
    assert after["requests_aborted"] - before["requests_aborted"] == 1
    assert after["forward_passes"] == before["forward_passes"]


# ---- long prompts: chunked prefill, and aborts inside a forward pass ----


def long_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """About `tokens` ids of varied text (a cold prompt for any test that salts it)."""
    text = " ".join(f"Line {i}: the customer wrote again about order {i * 7919 % 10007}." for i in range(tokens // 8))
    ids = tokenizer.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


def test_a_chunked_prefill_answers_as_one_pass_would_and_its_prefix_is_cached(
        engine: str, model_dir: Path, tokenizer: Any, labels: list[int]) -> None:
    from worker.cpu_engine.server import PREFILL_CHUNK

    prefix = long_prompt(tokenizer, 4 * PREFILL_CHUNK + 37)  # several chunks and a ragged end
    question = suffix(tokenizer, "Is this a long thread?")
    key = salt()
    generate(engine, warm_body(prefix, extra_key=key))
    branch = generate(engine, score_body(prefix + question, labels, extra_key=key))
    assert branch["meta_info"]["cached_tokens"] == len(prefix)  # the chunked warm call's KV was kept whole
    loaded = engine_model.load_model(model_dir, dtype="float32")
    logits, _ = loaded.forward(prefix + question, None)  # the whole prompt in one unchunked pass
    expected = torch.log_softmax(logits, dim=-1)[labels].tolist()
    assert label_logprobs(branch) == pytest.approx(expected, abs=1e-4)
    cold = generate(engine, score_body(prefix + question, labels, extra_key=salt()))  # chunked, no cache at all
    assert label_logprobs(cold) == pytest.approx(expected, abs=1e-4)


async def test_an_abort_frees_the_engine_within_a_second_of_a_4000_token_prefill(
        engine: str, tokenizer: Any, labels: list[int]) -> None:
    prompt = long_prompt(tokenizer, 4000)
    before = stats(engine)
    async with httpx.AsyncClient(base_url=engine, timeout=600) as client:
        call = asyncio.create_task(client.post("/generate", json=score_body(prompt, labels, rid="long",
                                                                            extra_key=salt())))
        while stats(engine)["prefill_chunks"] == before["prefill_chunks"]:  # until its prefill is under way
            assert not call.done(), call.result().text
            await asyncio.sleep(0.02)
        aborted_at = asyncio.get_running_loop().time()
        await client.post("/abort_request", json={"rid": "long"})
        while stats(engine)["computes_stopped"] == before["computes_stopped"]:
            await asyncio.sleep(0.01)
        freed_after = asyncio.get_running_loop().time() - aborted_at
        answer = (await asyncio.wait_for(call, timeout=5)).json()
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert freed_after < 1.0, f"the engine went on computing {freed_after:.2f} s after the abort"
    after = stats(engine)
    assert after["forward_passes"] == before["forward_passes"]  # the prompt was never computed to its logits
    assert after["queue_depth"] == 0
