"""The reference CPU engine's HTTP server: the subset of SGLang's native API the worker uses (as SGLang
0.5.23 answers it: tests/data/sglang-0.5.23-cpu/), answered by a single compute thread with a prefix KV
cache. A batched /generate call is computed as a batch: its prompts' shared start once, then all their
tails in one packed pass. Long prompts are prefilled in chunks (as SGLang's chunked prefill does), and
an abort is looked for before every decoder layer of every forward pass: a cancelled prompt frees the
engine within one layer's time, not at the end of its prefill."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from worker.cpu_engine.model import CpuDtype, LoadedModel, load_model, resolve_model
from worker.cpu_engine.packing import chunks, forward_packed
from worker.cpu_engine.prefix_cache import KeyValues, PrefixCache, common_prefix_length

log = logging.getLogger(__name__)

DEFAULT_CACHE_TOKENS = 65536
# The most new tokens packed into one forward pass: bounds its [new, past + new] attention mask.
PACKED_TOKENS = 1024
# The most tokens of a prompt's start prefilled in one forward pass. Aborts are seen between decoder layers
# (`ForwardStopped`), so this bounds memory and the work one pass holds, not how fast an abort lands: on a
# 2-vCPU machine at load average 6, SmolLM2-135M took ~11 s for 128 or 256 tokens after 3,744 of past.
PREFILL_CHUNK = 256
VERSION = "openjev-cpu-engine"


class BadRequest(Exception):
    """A request this engine refuses; answered 400 with SGLang's error body."""


class ForwardStopped(Exception):
    """Raised before a decoder layer once every prompt of the group being computed is aborted."""


class SamplingParams(BaseModel):
    """The sampling parameters this engine honours; any other key is refused, as SGLang 0.5.23 does."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = 128  # SGLang's default; only 0 (prefill only) and 1 are served
    temperature: float = 1.0


class GenerateBody(BaseModel):
    """POST /generate. Per-prompt fields take one value, or a list with one value per batch item.
    Keys outside the subset are ignored, as SGLang does."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    rid: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    token_ids_logprob: list[int] | list[list[int]] | None = None
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None


class AbortBody(BaseModel):
    """POST /abort_request."""

    rid: str = ""
    abort_all: bool = False


@dataclass(frozen=True)
class StepRequest:
    """One prompt of a /generate call, validated: everything the compute thread needs."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int  # 0: logprobs of the next token only; 1: also emit the greedy token
    temperature: float
    return_logprob: bool
    logprob_start_len: int  # -1: output positions only; >= 0 caps the prefix-cache match, as in SGLang
    token_ids_logprob: list[int] | None
    top_logprobs_num: int
    return_text_in_logprobs: bool
    salt: str  # extra_key and cache_salt together: the prefix-cache namespace


@dataclass
class QueuedStep:
    """A StepRequest on its way through the queue."""

    step: StepRequest
    future: asyncio.Future[dict[str, Any]]  # the response body; set on the event loop only
    received: float  # time.monotonic() at admission
    cancelled: threading.Event = field(default_factory=threading.Event)  # the compute thread skips it


@dataclass
class EngineStats:
    """Counters for tests and operators (GET /stats). Each has one writer: the event loop or the thread."""

    requests_received: int = 0  # prompts admitted (a batch counts each prompt)
    requests_finished: int = 0  # prompts computed to the end and answered
    requests_aborted: int = 0  # prompts answered with finish_reason abort (abort call or client gone)
    aborts_received: int = 0  # calls to /abort_request, live rid or not
    prompt_tokens: int = 0  # prompt tokens of the prompts that reached the model
    cached_tokens: int = 0  # of those, the tokens whose KV came from the prefix cache
    forward_passes: int = 0  # prompts or packed batches computed to their logits (a chunked prefill is one)
    prefill_chunks: int = 0  # forward calls over chunks of a prompt's start (PREFILL_CHUNK tokens at most)
    computes_stopped: int = 0  # computations stopped part way (between chunks or layers): their prompts were aborted


def expand(body: GenerateBody, vocab_size: int, max_context: int) -> tuple[list[StepRequest], bool]:
    """Validate a /generate body and split it into one StepRequest per prompt; raises BadRequest.

    Returns the prompts and whether the body was a batch (answered with a list).
    """
    if body.stream:
        raise BadRequest("stream is not supported by the reference CPU engine")
    if body.input_ids is None:
        raise BadRequest("the reference CPU engine takes input_ids only (text is not supported)")
    if not body.input_ids:
        raise BadRequest("input_ids is empty")
    batched = isinstance(body.input_ids[0], list)
    prompts: list[list[int]] = body.input_ids if batched else [body.input_ids]  # type: ignore[assignment]
    rids = _rids(body.rid, len(prompts), batched)
    steps = [_step(body, i, len(prompts), prompt, rids[i], vocab_size, max_context)
             for i, prompt in enumerate(prompts)]
    return steps, batched


def _rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    if not batched:
        raise BadRequest("rid must be a string for a single prompt")
    if len(rid) != count:
        raise BadRequest(f"rid has {len(rid)} items for {count} prompts")
    if len(set(rid)) != count:
        raise BadRequest("rid values must be unique within a batch")
    return rid


def _pick(value: Any, index: int, count: int, name: str) -> Any:
    """One batch item's value of a field that is either shared or given per item."""
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise BadRequest(f"{name} has {len(value)} items for {count} prompts")
    return value[index]


def _step(body: GenerateBody, i: int, count: int, prompt: list[int], rid: str, vocab_size: int,
          max_context: int) -> StepRequest:
    _check_ids(prompt, vocab_size, "input_ids")
    if len(prompt) > max_context:
        raise BadRequest(f"{len(prompt)} prompt tokens exceed the context length {max_context}")
    sampling = _sampling(_pick(body.sampling_params, i, count, "sampling_params") or {})
    label_ids = body.token_ids_logprob
    if label_ids and isinstance(label_ids[0], list):
        label_ids = _pick(label_ids, i, count, "token_ids_logprob")
    if label_ids is not None:
        _check_ids(label_ids, vocab_size, "token_ids_logprob")  # type: ignore[arg-type]
    return StepRequest(
        rid=rid, input_ids=prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
        return_logprob=bool(_pick(body.return_logprob, i, count, "return_logprob")),
        logprob_start_len=int(_pick(body.logprob_start_len, i, count, "logprob_start_len")),
        token_ids_logprob=label_ids,  # type: ignore[arg-type]
        top_logprobs_num=int(_pick(body.top_logprobs_num, i, count, "top_logprobs_num")),
        return_text_in_logprobs=body.return_text_in_logprobs,
        salt=f"{_pick(body.extra_key, i, count, 'extra_key') or ''}\x00"
             f"{_pick(body.cache_salt, i, count, 'cache_salt') or ''}",
    )


def _sampling(raw: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(raw) - set(SamplingParams.model_fields))
    if unknown:
        raise BadRequest(f"unknown field `{unknown[0]}` in sampling_params; the reference CPU engine takes "
                         f"only {', '.join(SamplingParams.model_fields)}")
    try:
        params = SamplingParams.model_validate(raw)
    except ValidationError as exc:
        raise BadRequest(f"sampling_params: {_describe(exc.errors())}") from exc
    if params.max_new_tokens not in (0, 1):
        raise BadRequest(f"max_new_tokens={params.max_new_tokens}: the reference CPU engine computes one "
                         "step only (0 or 1)")
    if params.temperature < 0:
        raise BadRequest("temperature must be >= 0")
    return params


def _check_ids(ids: list[int], vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{name} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _describe(errors: Any) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errors)


class ComputeQueue:
    """FIFO of /generate calls computed one at a time by a single thread, each call's prompts together.

    The event loop owns admission, aborts and answers (the live rids, the futures); the thread owns the
    model and the prefix cache. The thread checks for aborts before each stage: queued, delayed,
    looked up, computed; an aborted prompt of a batch leaves the others to be computed.
    """

    def __init__(self, model: LoadedModel, cache_tokens: int, compute_delay: float) -> None:
        """`cache_tokens`: prefix-cache capacity; `compute_delay`: seconds slept (abortably) per prompt before
        a call's compute (a batch of n sleeps n times as long), to simulate a slow GPU in tests."""
        self.model = model
        self.cache = PrefixCache(cache_tokens)
        self.compute_delay = compute_delay
        self.stats = EngineStats()
        self._live: dict[str, QueuedStep] = {}
        self._computing: list[QueuedStep] = []  # the group the thread computes now (the thread writes it)
        for module in model.model.modules():
            if type(module).__name__.endswith("DecoderLayer"):  # LlamaDecoderLayer, Qwen2DecoderLayer, ...
                module.register_forward_pre_hook(self._stop_if_aborted)
        self._calls: queue.SimpleQueue[list[QueuedStep] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="cpu-engine-compute", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the compute thread; answers are delivered on `loop`."""
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        """Let the thread finish its current prompt and exit."""
        self._calls.put(None)
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        """Whether the compute thread is running."""
        return self._thread.is_alive()

    def queue_depth(self) -> int:
        """Prompts admitted and not yet answered."""
        return len(self._live)

    def submit(self, steps: list[StepRequest]) -> list[QueuedStep]:
        """Queue the prompts of one call (event loop only); raises BadRequest for a rid already live."""
        clash = [s.rid for s in steps if s.rid in self._live]
        if clash:
            raise BadRequest(f"rid {clash[0]!r} is already live")
        jobs = []
        for step in steps:
            job = QueuedStep(step, asyncio.get_running_loop().create_future(), time.monotonic())
            self._live[step.rid] = job
            self.stats.requests_received += 1
            jobs.append(job)
        self._calls.put(jobs)
        return jobs

    def abort(self, rid: str, message: str) -> bool:
        """Answer a live prompt with finish_reason abort now (event loop only); False if `rid` is not live.
        A queued prompt is then dropped unseen; a running one is dropped at its next stage."""
        job = self._live.get(rid)
        if job is None:
            return False
        job.cancelled.set()
        self._settle(job, _abort_body(job.step, message))
        return True

    def abort_all(self, message: str) -> None:
        """Abort every live prompt."""
        for rid in list(self._live):
            self.abort(rid, message)

    def _settle(self, job: QueuedStep, body: dict[str, Any] | BaseException) -> None:
        # Runs on the event loop: the one place a job ends, so each ends once and is counted once.
        if self._live.get(job.step.rid) is job:
            del self._live[job.step.rid]
        if job.future.done():
            return
        if isinstance(body, BaseException):
            job.future.set_exception(body)
            return
        aborted = body["meta_info"]["finish_reason"]["type"] == "abort"
        if aborted:
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        body["meta_info"]["e2e_latency"] = time.monotonic() - job.received
        job.future.set_result(body)

    def _stop_if_aborted(self, *_hook_arguments: Any) -> None:
        """ForwardStopped once every prompt of the group being computed is aborted (the compute thread's
        look before each prefill chunk, and a forward pre-hook on every decoder layer)."""
        if self._computing and all(job.cancelled.is_set() for job in self._computing):
            raise ForwardStopped

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            self._delay(call)
            for group in _groups([job for job in call if not job.cancelled.is_set()]):
                self._computing = group
                try:
                    bodies: list[dict[str, Any] | BaseException | None] = list(self._compute(group))
                except ForwardStopped:
                    self.stats.computes_stopped += 1
                    bodies = [None] * len(group)  # each was answered with its abort already
                except Exception as exc:  # one bad call must fail, not stop the engine
                    log.exception("compute failed for %s", group[0].step.rid)
                    bodies = [exc] * len(group)
                finally:
                    self._computing = []
                assert self._loop is not None
                for job, body in zip(group, bodies, strict=True):
                    if body is not None:
                        self._loop.call_soon_threadsafe(self._settle, job, body)

    def _delay(self, call: list[QueuedStep]) -> None:
        """Sleep `compute_delay` per prompt, or less once every prompt of the call is aborted."""
        deadline = time.monotonic() + self.compute_delay * len(call)
        for job in call:  # waits on each prompt in turn: an abort of all of them ends the wait early
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            job.cancelled.wait(remaining)

    def _compute(self, group: list[QueuedStep]) -> Iterator[dict[str, Any] | None]:
        """Answers for prompts under one salt: the start they share (up to what each may reuse) is looked
        up in the cache and the rest of it computed once; their tails after it in the same pass."""
        steps = [job.step for job in group]
        tokens = [torch.tensor(step.input_ids, dtype=torch.long) for step in steps]
        shared = min(_reuse_limit(step) for step in steps)
        for other in tokens[1:]:
            shared = min(shared, common_prefix_length(tokens[0], other))
        if len(group) > 1 and any(self.cache.match_length(step.salt, ids, _reuse_limit(step)) > shared
                                  for step, ids in zip(steps, tokens, strict=True)):
            # a prompt cached beyond the start the group shares reuses its own KV, as in SGLang: one by one
            return iter([answer for job in group for answer in self._compute([job])])
        hit = self.cache.longest_prefix(steps[0].salt, tokens[0], shared)
        if all(job.cancelled.is_set() for job in group):  # one prompt of a batch computed one by one
            return iter([None] * len(group))
        if len(group) == 1:
            shared = len(steps[0].input_ids) - 1  # the prompt's last token is computed for its logits
        past = self._prefill(steps[0].input_ids[hit.length:shared], hit.kv)
        if len(group) == 1:
            logits, kv = self.model.forward(steps[0].input_ids[shared:], past)
            all_logits, prompt_kv = [logits], lambda _: kv
        else:
            packed = forward_packed(self.model, past, shared, [], [step.input_ids[shared:] for step in steps])
            all_logits, prompt_kv = packed.logits, packed.prompt_kv
        self.stats.forward_passes += 1
        for index, step in enumerate(steps):
            self.stats.prompt_tokens += len(step.input_ids)
            self.stats.cached_tokens += hit.length
            self.cache.store(step.salt, tokens[index], prompt_kv(index))  # one copy at a time: memory stays flat
        return (None if job.cancelled.is_set() else _answer(self.model, job.step, logits, hit.length)
                for job, logits in zip(group, all_logits, strict=True))

    def _prefill(self, tokens: list[int], past: KeyValues | None) -> KeyValues | None:
        """The KV of `past` extended by `tokens`, computed PREFILL_CHUNK tokens at a time."""
        for start in range(0, len(tokens), PREFILL_CHUNK):
            self._stop_if_aborted()
            _, past = self.model.forward(tokens[start:start + PREFILL_CHUNK], past)
            self.stats.prefill_chunks += 1
        return past


def _reuse_limit(step: StepRequest) -> int:
    """How many leading tokens of a prompt may come from the cache: never its last (its logits are the
    answer), and no more than a `logprob_start_len` >= 0, as in SGLang."""
    limit = len(step.input_ids) - 1
    if step.return_logprob and step.logprob_start_len >= 0:
        limit = min(limit, step.logprob_start_len)
    return limit


def _groups(jobs: list[QueuedStep]) -> Iterator[list[QueuedStep]]:
    """Consecutive prompts under one salt, in chunks that pack at most PACKED_TOKENS tokens of their own
    (what each has beyond its start in common with the first; the shared start is not counted)."""
    for _, same_salt in itertools.groupby(jobs, key=lambda job: job.step.salt):
        group = list(same_salt)
        first = torch.tensor(group[0].step.input_ids)
        own = [1] + [len(job.step.input_ids) - common_prefix_length(first, torch.tensor(job.step.input_ids))
                     for job in group[1:]]
        for indices in chunks(own, PACKED_TOKENS):
            yield [group[i] for i in indices]


def _answer(model: LoadedModel, step: StepRequest, logits: torch.Tensor, cached: int) -> dict[str, Any]:
    """The /generate response body of a computed prompt (e2e_latency is added when it is delivered)."""
    greedy = step.max_new_tokens == 0 or step.temperature == 0
    # SGLang's semantics: prefill-only and greedy requests get unscaled logprobs, others post-temperature.
    logprobs = torch.log_softmax(logits if greedy else logits / step.temperature, dim=-1)
    output_ids = [int(torch.argmax(logits))] if step.max_new_tokens == 1 else []
    meta: dict[str, Any] = {
        "id": step.rid,
        "finish_reason": {"type": "length", "length": step.max_new_tokens},
        "prompt_tokens": len(step.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": cached,
    }
    if step.return_logprob:
        meta |= _logprob_fields(model, step, logprobs, output_ids)
    return {"text": model.tokenizer.decode(output_ids), "output_ids": output_ids, "meta_info": meta}


def _logprob_fields(model: LoadedModel, step: StepRequest, logprobs: torch.Tensor,
                    output_ids: list[int]) -> dict[str, Any]:
    def entries(ids: list[int]) -> list[list[Any]]:
        values = logprobs[ids].tolist() if ids else []
        texts = [model.tokenizer.decode([t]) if step.return_text_in_logprobs else None for t in ids]
        return [[value, token, text] for value, token, text in zip(values, ids, texts, strict=True)]

    fields: dict[str, Any] = {"output_token_logprobs": entries(output_ids)}
    if step.token_ids_logprob is not None:
        # Position 0 is reported even without a decode step (max_new_tokens 0), as SGLang's prefill-only path does.
        fields["output_token_ids_logprobs"] = [entries(step.token_ids_logprob)]
    if step.top_logprobs_num > 0:
        top = torch.topk(logprobs, min(step.top_logprobs_num, len(logprobs))).indices.tolist()
        fields["output_top_logprobs"] = [entries(top)]
    return fields


def _abort_body(step: StepRequest, message: str) -> dict[str, Any]:
    return {"text": "", "output_ids": [], "meta_info": {
        "id": step.rid,
        "finish_reason": {"type": "abort", "message": message},
        "prompt_tokens": len(step.input_ids),
        "completion_tokens": 0,
        "cached_tokens": 0,
    }}


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                        status_code=status)


async def _await_answers(request: Request, compute: ComputeQueue, jobs: list[QueuedStep]) -> None:
    """Wait for every job; abort the rest if the client goes away, so no compute is spent on it."""
    pending = {job.future for job in jobs}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.25)
        if pending and await request.is_disconnected():
            for job in jobs:
                compute.abort(job.step.rid, "client disconnected")


def create_app(model: LoadedModel, compute_delay: float = 0.0, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> FastAPI:
    """The engine's FastAPI app around an already loaded model; the compute thread runs during its lifespan."""
    compute = ComputeQueue(model, cache_tokens, compute_delay)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        compute.start(asyncio.get_running_loop())
        yield
        compute.abort_all("server shutting down")
        compute.stop()

    app = FastAPI(title="openjev reference CPU engine", lifespan=lifespan)
    app.state.compute = compute

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _describe(exc.errors()))

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Any:
        steps, batched = expand(body, model.vocab_size, model.max_context)
        jobs = compute.submit(steps)
        await _await_answers(request, compute, jobs)
        try:
            answers = [job.future.result() for job in jobs]
        except Exception as exc:
            return _error(500, f"compute failed: {exc!r}")
        return answers if batched else answers[0]

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> Response:
        compute.stats.aborts_received += 1
        if body.abort_all:
            compute.abort_all("aborted by abort_all")
        else:
            compute.abort(body.rid, "aborted by /abort_request")
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if compute.alive() else 503)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": str(model.model_dir), "tokenizer_path": str(model.model_dir),
                "is_generation": True, "served_model_name": model.served_name}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"model_path": str(model.model_dir), "tokenizer_path": str(model.model_dir),
                "served_model_name": model.served_name, "max_context_length": model.max_context,
                "version": VERSION, "compute_delay": compute_delay, "cache_tokens": cache_tokens,
                "torch_threads": torch.get_num_threads()}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return asdict(compute.stats) | {"queue_depth": compute.queue_depth(), "cache_entries": len(compute.cache),
                                        "cache_size_tokens": compute.cache.size_tokens}

    return app


def run(host: str, port: int, model: str | None, cache_dir: Path, compute_delay: float = 0.0,
        cache_tokens: int = DEFAULT_CACHE_TOKENS, dtype: CpuDtype = "auto") -> None:
    """Serve the engine until interrupted (blocking). The model is converted/loaded before the port opens.

    `model`: a catalog name (`qwen2.5-1.5b`), an HF-format directory or `.gguf` file, or None for the bundled
    SmolLM2-135M-Instruct, converted once into `cache_dir`. `compute_delay`: seconds slept before each prompt
    (tests). `cache_tokens`: prefix-cache capacity in tokens. `dtype`: see `load_model`.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpu-engine %(levelname)s %(message)s")
    model_dir, served_name = resolve_model(model, cache_dir)
    loaded = load_model(model_dir, served_name, dtype=dtype)
    log.info("serving %s on http://%s:%d", served_name, host, port)
    uvicorn.run(create_app(loaded, compute_delay, cache_tokens), host=host, port=port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
