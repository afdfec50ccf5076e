"""HTTP client for the subset of SGLang's native API the worker uses (as SGLang
0.5.23 answers it, captured in tests/data/sglang-0.5.23-cpu/):
`POST /generate` with input ids and label logprobs (one prompt, or a batch of them in one call),
`POST /abort_request` by rid. Both of SGLang's HTTP frontends are understood, as measured on 0.5.23
(`tests/data/sglang-0.5.23-cpu/`). Nothing the engine answers is trusted unchecked: an answer that is
too big, not the documented shape, or carries logprobs that are not finite log-probabilities is an
`EngineError`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from common.background import BackgroundWork
from worker.engine_http import TRANSPORT_ERRORS, CallTimeout, EngineHttp

log = logging.getLogger("openjev.worker")

DEFAULT_MAX_ANSWER_BYTES = 1024 * 1024

# A full-vocabulary log-probability is <= 0; float rounding in the engine's log_softmax may go a hair above.
LOGPROB_CEILING = 1e-3

# How SGLang's Rust frontend answers a call that was aborted: 499 "client disconnected", or 500
# with this message when the abort came right after the call.
ABORTED_STATUS = 499
TRUNCATED_BY_ABORT = "response truncated before completion"

# SGLang's Python frontend answers 200 to an abort that arrives before the call is registered, and
# drops it: the call then runs to completion. So an abort is sent again at these delays (seconds);
# a repeat for a call that has ended is a no-op (an unknown rid is answered 200 and ignored).
ABORT_REPEATS = (0.3, 1.0)


class EngineError(Exception):
    """The engine failed a call (HTTP error, malformed or untrustworthy answer, unreachable)."""


class EngineUnavailable(EngineError):
    """The engine could not answer the call (unreachable, connection reset, a 5xx, no answer within the
    call limit, or it aborted the call itself): nothing about the request caused it, so the job may run
    again, on another engine or on this one once it answers again."""


class EngineAborted(EngineUnavailable):
    """The engine reports the call as aborted (200 with an abort finish reason, or the Rust
    frontend's 499, or its 500 "response truncated before completion"). The worker's own aborts
    cancel the job first, so one that reaches the job came from the engine (a restart, an abort_all)."""


class EngineRefused(EngineError):
    """The engine refused the request itself with a 4xx (a prompt over its context, a label id
    outside its vocabulary): running the job again would fail the same way."""


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's answer: label logprobs in request order, and the token figures."""

    label_logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int | None  # None when the engine does not report it (SGLang's Rust frontend before 0.5.23)


@dataclass(frozen=True)
class BranchPrompt:
    """One branch as the engine sees it: its rid, the tokens after the shared prefix, the labels to score."""

    rid: str
    suffix_ids: list[int]
    label_ids: list[int]


class SharedPrefix:
    """A job's shared prefix ids, serialised to JSON once and spliced into the warm call and every
    branch's `input_ids` (with 8000-token states, encoding the same ids per branch dominated the worker)."""

    def __init__(self, prefix_ids: list[int]) -> None:
        self.length = len(prefix_ids)
        self.json = orjson.dumps(prefix_ids)  # b"[1,2,3]"

    def followed_by(self, suffix_ids: list[int]) -> orjson.Fragment:
        """The JSON array of the prefix ids and then `suffix_ids`, without re-encoding the prefix."""
        if not suffix_ids:
            return orjson.Fragment(self.json)
        if not self.length:
            return orjson.Fragment(orjson.dumps(suffix_ids))
        return orjson.Fragment(self.json[:-1] + b"," + orjson.dumps(suffix_ids)[1:])


class EngineClient:
    """Talks to one engine over a pooled HTTP connection."""

    def __init__(self, base_url: str, api_key: str | None = None, max_connections: int = 128,
                 warm_token_ids_logprob: bool = False, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
                 call_limit: float | None = None) -> None:
        """`warm_token_ids_logprob`: send `token_ids_logprob` on the warm call too (SGLang 0.5.19,
        sgl-project/sglang#34719, crashes when a batch mixes requests with and without it).
        `max_answer_bytes`: the most response bytes read per prompt of a call; a bigger answer is an error.
        `call_limit`: seconds a call may go unanswered before the engine counts as hung (EngineUnavailable);
        None: only the job's deadline bounds it."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = EngineHttp(base_url, headers, max_connections=max_connections)
        self.warm_token_ids_logprob = warm_token_ids_logprob
        self.max_answer_bytes = max_answer_bytes
        self.call_limit = call_limit
        self._repeats = BackgroundWork(log)  # aborts being sent again
        self.last_answer_at = 0.0  # monotonic time of the last 200 answer: proof the engine makes progress
        self.in_flight = 0  # calls sent and not answered yet

    @property
    def last_seen_working(self) -> float:
        """Monotonic time the engine was last seen working: now while calls are in flight (their
        jobs' deadlines bound how long that lasts), else when it last answered one."""
        return time.monotonic() if self.in_flight else self.last_answer_at

    async def close(self) -> None:
        await self._repeats.close()
        await self._http.aclose()

    async def warm(self, prefix: SharedPrefix, rid: str, timeout: float) -> GenerateResult:
        """Prefill the shared prefix (no decode step) so the branches find it cached."""
        body: dict[str, Any] = {
            "input_ids": orjson.Fragment(prefix.json),
            "rid": rid,
            "sampling_params": {"max_new_tokens": 0},
        }
        if self.warm_token_ids_logprob:
            body |= {"return_logprob": True, "logprob_start_len": -1, "token_ids_logprob": [0],
                     "top_logprobs_num": 0, "return_text_in_logprobs": False}
        answer = await self._generate(orjson.dumps(body), rid, 1, timeout)
        meta = _meta_info(answer, rid)
        return GenerateResult([], meta["prompt_tokens"], _cached(meta))

    async def score_branches(self, prefix: SharedPrefix, branches: Sequence[BranchPrompt], timeout: float,
                             max_new_tokens: int = 1) -> list[GenerateResult]:
        """The unscaled logprob of each branch's label ids as the next token after prefix + suffix, in
        one `/generate` call: SGLang's batch form (list-valued `input_ids` and `rid`) for several
        branches, the single form for one. Results are in `branches` order."""
        rids = [b.rid for b in branches]
        batched = len(branches) > 1
        call = rids[0] if not batched else f"{rids[0]} and {len(rids) - 1} more"
        answer = await self._generate(score_request(prefix, branches, max_new_tokens), call, len(branches), timeout)
        answers = answer if batched else [answer]
        if not isinstance(answers, list) or len(answers) != len(branches):
            raise EngineError(f"engine answered a batch of {len(branches)} prompts with "
                              f"{len(answers) if isinstance(answers, list) else type(answers).__name__}")
        results = []
        for branch, item in zip(branches, answers, strict=True):
            meta = _meta_info(item, branch.rid)
            results.append(GenerateResult(_label_logprobs(meta, branch.label_ids), meta["prompt_tokens"],
                                          _cached(meta)))
        return results

    async def abort(self, rid: str) -> None:
        """Ask the engine to drop a live request; best effort (it may already have finished). The
        request is sent now and again in the background (`ABORT_REPEATS`), in case the engine had
        not registered the call yet."""
        await self._send_abort(rid)
        self._repeats.start(self._repeat_abort(rid), f"repeating the abort of {rid} failed")

    async def _send_abort(self, rid: str) -> None:
        with contextlib.suppress(*TRANSPORT_ERRORS, CallTimeout):
            await self._http.request("POST", "/abort_request", 5.0, orjson.dumps({"rid": rid}))

    async def _repeat_abort(self, rid: str) -> None:
        waited = 0.0
        for delay in ABORT_REPEATS:
            await asyncio.sleep(delay - waited)
            waited = delay
            await self._send_abort(rid)

    async def _generate(self, body: bytes, rid: str, prompts: int, timeout: float) -> Any:
        """POST /generate and return its decoded JSON, read no further than the answer bound."""
        limit = prompts * self.max_answer_bytes
        hung = self.call_limit is not None and self.call_limit < timeout  # the call limit ends it before the deadline
        call_timeout = max(min(timeout, self.call_limit or timeout), 0.001)
        self.in_flight += 1
        try:
            status, raw = await self._http.request("POST", "/generate", call_timeout, body, limit=limit)
        except CallTimeout as exc:
            if hung:
                raise EngineUnavailable(f"engine call {rid} got no answer within {self.call_limit:g} s") from exc
            raise TimeoutError(f"engine call {rid} timed out") from exc
        except TRANSPORT_ERRORS as exc:
            raise EngineUnavailable(f"engine unreachable: {exc!r}") from exc
        finally:
            self.in_flight -= 1
        if raw is None:
            raise EngineError(f"engine answer to {rid} exceeds {limit} bytes ({prompts} prompts)")
        if status != 200:
            raise _http_error(status, _error_message(raw), rid)
        self.last_answer_at = time.monotonic()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"engine answered 200 with invalid JSON: {exc}") from exc


def score_request(prefix: SharedPrefix, branches: Sequence[BranchPrompt], max_new_tokens: int = 1) -> bytes:
    """The `/generate` body of a branch call: SGLang's batch form (list-valued `input_ids` and `rid`, one
    `token_ids_logprob` list per prompt where they differ) for several branches, the single form for one."""
    rids = [b.rid for b in branches]
    label_ids = [b.label_ids for b in branches]
    batched = len(branches) > 1
    body = {
        "input_ids": [prefix.followed_by(b.suffix_ids) for b in branches] if batched
        else prefix.followed_by(branches[0].suffix_ids),
        "rid": rids if batched else rids[0],
        # temperature 0 keeps the returned logprobs unscaled; ours is applied in the softmax.
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": -1,
        # One list for the whole batch when every branch asks for the same labels, else one per branch.
        "token_ids_logprob": label_ids if batched and any(ids != label_ids[0] for ids in label_ids)
        else label_ids[0],
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
    }
    return orjson.dumps(body)


def _meta_info(answer: Any, rid: str) -> dict[str, Any]:
    """A prompt's `meta_info`, checked for what the worker reads; raises EngineAborted for an abort."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise EngineError(f"engine answer to {rid} has no meta_info object")
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise EngineAborted(f"engine aborted {rid}: {finish.get('message', '')}")
    if not _is_count(meta.get("prompt_tokens")):
        raise EngineError(f"engine answer to {rid} lacks a prompt_tokens count")
    return meta


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _http_error(status: int, message: str, rid: str) -> EngineError:
    """What an engine's non-200 answer means: an abort, the engine's fault (5xx, 429), or the request's (4xx)."""
    if _is_abort(status, message):
        return EngineAborted(f"engine aborted {rid}: {message}")
    if status >= 500 or status == 429:
        return EngineUnavailable(f"engine answered {status}: {message}")
    if 400 <= status < 500:
        return EngineRefused(f"engine answered {status}: {message}")
    return EngineError(f"engine answered {status}: {message}")


def _is_abort(status: int, message: str) -> bool:
    return status == ABORTED_STATUS or (status == 500 and TRUNCATED_BY_ABORT in message)


def _cached(meta: dict[str, Any]) -> int | None:
    value = meta.get("cached_tokens")
    return value if _is_count(value) else None


def _label_logprobs(meta: dict[str, Any], label_ids: list[int]) -> list[float]:
    try:
        position = meta["output_token_ids_logprobs"][0]
        by_id = {int(entry[1]): float(entry[0]) for entry in position}
        values = [by_id[token] for token in label_ids]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(f"engine answer to {meta.get('id')} lacks the requested label logprobs") from exc
    bad = [v for v in values if not (math.isfinite(v) and v <= LOGPROB_CEILING)]
    if bad:
        raise EngineError(f"engine answer to {meta.get('id')} has label logprobs that are not log-probabilities: "
                          f"{bad[:3]}")
    return values


def _error_message(raw: bytes) -> str:
    """The message of an error answer, in any of the shapes SGLang uses: `{"error": "..."}`,
    `{"error": {"message", "code"?}}`, `{"object": "error", "message"}`, or plain text."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:300].decode(errors="replace")
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error[:300]
        if isinstance(error, dict):
            return str(error.get("message", body))[:300]
        return str(body.get("message", body))[:300]
    return str(body)[:300]
