"""HTTP client for the subset of SGLang's native API the worker uses (`spec/sglang.md`):
`POST /generate` with input ids and label logprobs, `POST /abort_request` by rid. Both of SGLang's
HTTP frontends are understood, as measured on 0.5.23 (`tests/data/sglang-0.5.23-cpu/`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

# How SGLang's Rust frontend answers a call that was aborted: 499 "client disconnected", or 500
# with this message when the abort came right after the call.
ABORTED_STATUS = 499
TRUNCATED_BY_ABORT = "response truncated before completion"

# SGLang's Python frontend answers 200 to an abort that arrives before the call is registered, and
# drops it: the call then runs to completion. So an abort is sent again at these delays (seconds);
# a repeat for a call that has ended is a no-op (an unknown rid is answered 200 and ignored).
ABORT_REPEATS = (0.3, 1.0)


class EngineError(Exception):
    """The engine failed a call (HTTP error, malformed answer, unreachable)."""


class EngineAborted(EngineError):
    """The engine reports the call as aborted (200 with an abort finish reason, or the Rust
    frontend's 499, or its 500 "response truncated before completion")."""


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's answer: label logprobs in request order, and the token figures."""

    label_logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int | None  # None when the engine does not report it (SGLang's Rust frontend before 0.5.23)


class EngineClient:
    """Talks to one engine over a pooled HTTP connection."""

    def __init__(self, base_url: str, api_key: str | None = None, max_connections: int = 128,
                 warm_token_ids_logprob: bool = False) -> None:
        """`warm_token_ids_logprob`: send `token_ids_logprob` on the warm call too (SGLang 0.5.19,
        sgl-project/sglang#34719, crashes when a batch mixes requests with and without it)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=5.0),
            # Expire idle connections before the engine's uvicorn does (5 s), or a reused one may be
            # closed under a request in flight.
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=2.0),
        )
        self.warm_token_ids_logprob = warm_token_ids_logprob
        self._repeats: set[asyncio.Task[None]] = set()  # aborts being sent again
        self.last_answer_at = 0.0  # monotonic time of the last 200 answer: proof the engine makes progress

    async def close(self) -> None:
        for task in self._repeats:
            task.cancel()
        await asyncio.gather(*self._repeats, return_exceptions=True)
        await self._http.aclose()

    async def warm(self, prefix_ids: list[int], rid: str, timeout: float) -> GenerateResult:
        """Prefill the shared prefix (no decode step) so the branches find it cached."""
        body: dict[str, Any] = {
            "input_ids": prefix_ids,
            "rid": rid,
            "sampling_params": {"max_new_tokens": 0},
        }
        if self.warm_token_ids_logprob:
            body |= {"return_logprob": True, "logprob_start_len": -1, "token_ids_logprob": [0],
                     "top_logprobs_num": 0, "return_text_in_logprobs": False}
        meta = await self._generate(body, timeout)
        return GenerateResult([], int(meta["prompt_tokens"]), _cached(meta))

    async def score_labels(self, input_ids: list[int], label_ids: list[int], rid: str, timeout: float,
                           max_new_tokens: int = 1) -> GenerateResult:
        """The unscaled logprob of each label id as the next token after `input_ids`."""
        body = {
            "input_ids": input_ids,
            "rid": rid,
            # temperature 0 keeps the returned logprobs unscaled; ours is applied in the softmax.
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": -1,
            "token_ids_logprob": label_ids,
            "top_logprobs_num": 0,
            "return_text_in_logprobs": False,
        }
        meta = await self._generate(body, timeout)
        return GenerateResult(_label_logprobs(meta, label_ids), int(meta["prompt_tokens"]), _cached(meta))

    async def abort(self, rid: str) -> None:
        """Ask the engine to drop a live request; best effort (it may already have finished). The
        request is sent now and again in the background (`ABORT_REPEATS`), in case the engine had
        not registered the call yet."""
        await self._send_abort(rid)
        repeat = asyncio.create_task(self._repeat_abort(rid))
        self._repeats.add(repeat)
        repeat.add_done_callback(self._repeats.discard)

    async def _send_abort(self, rid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post("/abort_request", json={"rid": rid}, timeout=5.0)

    async def _repeat_abort(self, rid: str) -> None:
        waited = 0.0
        for delay in ABORT_REPEATS:
            await asyncio.sleep(delay - waited)
            waited = delay
            await self._send_abort(rid)

    async def _generate(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            response = await self._http.post("/generate", json=body, timeout=max(timeout, 0.001))
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"engine call {body['rid']} timed out") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"engine unreachable: {exc!r}") from exc
        if response.status_code != 200:
            message = _error_message(response)
            if _is_abort(response.status_code, message):
                raise EngineAborted(f"engine aborted {body['rid']}: {message}")
            raise EngineError(f"engine answered {response.status_code}: {message}")
        self.last_answer_at = time.monotonic()
        try:
            meta = response.json()["meta_info"]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError("engine answered 200 without meta_info") from exc
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise EngineAborted(f"engine aborted {body['rid']}: {finish.get('message', '')}")
        return meta


def _is_abort(status: int, message: str) -> bool:
    return status == ABORTED_STATUS or (status == 500 and TRUNCATED_BY_ABORT in message)


def _cached(meta: dict[str, Any]) -> int | None:
    value = meta.get("cached_tokens")
    return int(value) if isinstance(value, int) else None


def _label_logprobs(meta: dict[str, Any], label_ids: list[int]) -> list[float]:
    try:
        position = meta["output_token_ids_logprobs"][0]
        by_id = {int(entry[1]): float(entry[0]) for entry in position}
        return [by_id[token] for token in label_ids]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError("engine answer lacks the requested label logprobs") from exc


def _error_message(response: httpx.Response) -> str:
    """The message of an error answer, in any of the shapes SGLang uses: `{"error": "..."}`,
    `{"error": {"message", "code"?}}`, `{"object": "error", "message"}`, or plain text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error[:300]
        if isinstance(error, dict):
            return str(error.get("message", body))[:300]
        return str(body.get("message", body))[:300]
    return str(body)[:300]
