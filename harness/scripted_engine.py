"""A scripted engine at the HTTP boundary for fast worker and API tests: it speaks the same
`/generate` subset as SGLang and the CPU engine, with logprobs derived from a hash of the prompt,
and can be told to stall, fail or answer with output that must not be trusted. Never the only test of
a path: the CPU engine covers the real one.

Run: python -m harness.scripted_engine --port P
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

BAD_ANSWERS = ("nan_logprob", "inf_logprob", "minus_inf_logprob", "huge_logprob", "positive_logprob",
               "meta_info_string", "no_prompt_tokens", "huge", "endless")
HUGE_ANSWER_BYTES = 40 * 1024 * 1024


class Script:
    """What the engine does, set by tests through POST /script."""

    def __init__(self) -> None:
        self.delay = 0.0  # seconds each /generate stalls (abortable)
        self.slow_rid_infix: str | None = None  # rids containing this stall `slow_delay` instead (abortable)
        self.slow_delay = 0.0
        self.fail_rid_suffix: str | None = None  # rids ending with this answer with `fail_status`
        self.fail_status = 500
        self.fail_delay = 0.0  # seconds before the scripted failure is answered
        self.fail_body: Any = None  # the failure's JSON body (e.g. an answer captured from SGLang); None: a generic one
        self.fail_times: int | None = None  # how many calls fail before the engine answers again; None: every one
        self.register_delay = 0.0  # seconds before a call can be aborted; an earlier abort is dropped (SGLang's
        #                            Python frontend answers it 200 and the call runs to completion)
        self.report_cached = True  # False imitates an engine without cached_tokens (0.5.19's Rust frontend)
        self.healthy = True
        self.health_delay = 0.0  # seconds the health route takes to answer
        self.bad_answer: str | None = None  # answer 200 with untrustworthy output: one of BAD_ANSWERS


def create_app() -> FastAPI:
    app = FastAPI()
    script = Script()
    stats = {"requests_received": 0, "requests_finished": 0, "requests_aborted": 0, "aborts_received": 0,
             "prompt_tokens": 0, "cached_tokens": 0, "generate_calls": 0}
    live: dict[str, asyncio.Event] = {}
    received: list[str] = []  # rids in arrival order
    finished: list[str] = []  # rids answered with logprobs, in order
    aborted_rids: list[str] = []  # rids ended by an abort request, in order
    calls: list[list[str]] = []  # each /generate call's rids, in arrival order
    seen = PrefixTrie()
    background: set[asyncio.Task[Any]] = set()  # prompts of failed calls, still running

    @app.post("/script")
    async def set_script(body: dict[str, Any]) -> dict[str, Any]:
        for key, value in body.items():
            setattr(script, key, value)
        return vars(script)

    @app.get("/stats")
    async def get_stats() -> dict[str, Any]:
        return {**stats, "live": sorted(live), "received": received, "finished": finished, "aborted": aborted_rids,
                "calls": calls}

    @app.get("/health")
    async def health() -> JSONResponse:
        await asyncio.sleep(script.health_delay)
        return JSONResponse({}, status_code=200 if script.healthy else 503)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "scripted", "is_generation": True}

    @app.post("/abort_request")
    async def abort(body: dict[str, Any]) -> JSONResponse:
        stats["aborts_received"] += 1
        event = live.get(body.get("rid", ""))
        if event:
            event.set()
        return JSONResponse(None)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompts = batch_items(body)
        calls.append([rid for rid, _, _ in prompts])
        stats["generate_calls"] += 1
        failing = [rid for rid, _, _ in prompts if script.fail_rid_suffix and rid.endswith(script.fail_rid_suffix)]
        if failing and script.fail_times is not None:
            failing = failing if script.fail_times > 0 else []
            script.fail_times = max(0, script.fail_times - 1)
        items = [asyncio.create_task(run_prompt(rid, ids, labels, rid in failing)) for rid, ids, labels in prompts]
        if failing:
            # The call fails as a whole; its other prompts stay live in the engine until they end or are aborted.
            background.update(items)
            for item in items:
                item.add_done_callback(background.discard)
            await asyncio.sleep(script.fail_delay)
            failure = script.fail_body if script.fail_body is not None else {"object": "error",
                                                                              "message": "scripted failure"}
            return JSONResponse(failure, status_code=script.fail_status)
        answers = await asyncio.gather(*items)
        answer = answers if isinstance(body["input_ids"][0], list) else answers[0]
        if script.bad_answer == "endless":
            return StreamingResponse(endless(), media_type="application/json")
        if script.bad_answer:
            return Response(bad_answer(script.bad_answer, answer), media_type="application/json")
        return Response(orjson.dumps(answer), media_type="application/json")

    async def run_prompt(rid: str, ids: list[int], labels: list[int], failing: bool) -> dict[str, Any]:
        stats["requests_received"] += 1
        received.append(rid)
        if failing:
            return {}
        if script.register_delay:
            await asyncio.sleep(script.register_delay)
        aborted = asyncio.Event()
        live[rid] = aborted
        try:
            slow = script.slow_rid_infix is not None and script.slow_rid_infix in rid
            delay = script.slow_delay if slow else script.delay
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(aborted.wait(), delay)
            if aborted.is_set():
                stats["requests_aborted"] += 1
                aborted_rids.append(rid)
                return _meta(rid, ids, 0, None, [], {"type": "abort", "message": "aborted"})
        finally:
            live.pop(rid, None)
        cached = min(seen.insert(ids), len(ids) - 1)
        stats["requests_finished"] += 1
        finished.append(rid)
        stats["prompt_tokens"] += len(ids)
        stats["cached_tokens"] += cached
        logprobs = [[_logprob(ids, t), t, None] for t in labels]
        return _meta(rid, ids, cached if script.report_cached else None, logprobs, [], {"type": "length", "length": 1})

    return app


def batch_items(body: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
    """(rid, input ids, label ids) per prompt of a single or batched (SGLang list form) /generate body."""
    labels = body.get("token_ids_logprob") or []
    if not isinstance(body["input_ids"][0], list):
        return [(body["rid"], body["input_ids"], labels)]
    count = len(body["input_ids"])
    rids = body["rid"] if isinstance(body["rid"], list) else [f"{body['rid']}_{i}" for i in range(count)]
    per_item = labels if labels and isinstance(labels[0], list) else [labels] * count
    return list(zip(rids, body["input_ids"], per_item, strict=True))


def bad_answer(kind: str, answer: Any) -> bytes:
    """`answer` spoiled as `kind` says, serialised with the stdlib (which writes NaN and Infinity)."""
    first = answer[0] if isinstance(answer, list) else answer
    meta = first["meta_info"]
    spoilt = {"nan_logprob": math.nan, "inf_logprob": math.inf, "minus_inf_logprob": -math.inf,
              "positive_logprob": 2.5}
    if kind in spoilt:
        meta["output_token_ids_logprobs"][0][0][0] = spoilt[kind]
    elif kind == "huge_logprob":
        return json.dumps(answer).replace(repr(meta["output_token_ids_logprobs"][0][0][0]), "1e400", 1).encode()
    elif kind == "meta_info_string":
        first["meta_info"] = json.dumps(meta)
    elif kind == "no_prompt_tokens":
        del meta["prompt_tokens"]
    elif kind == "huge":
        first["text"] = "x" * HUGE_ANSWER_BYTES
    return json.dumps(answer).encode()


async def endless() -> AsyncIterator[bytes]:
    """A 200 body that never ends (no Content-Length): only a bounded reader gets past it."""
    yield b'{"text": "'
    while True:
        yield b"x" * 65536
        await asyncio.sleep(0)


class PrefixTrie:
    """Every prompt seen so far, as a token trie: like a radix cache that never evicts."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}

    def insert(self, ids: list[int]) -> int:
        """Add `ids`; returns how many leading tokens an earlier prompt already had."""
        node, common = self.root, 0
        for token in ids:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
            else:
                common += 1
            node = child
        return common


def _logprob(ids: list[int], token: int) -> float:
    digest = hashlib.sha256(repr((ids, token)).encode()).digest()
    return -0.1 - 6.0 * int.from_bytes(digest[:4], "big") / 2**32 - math.log(2)


def _meta(rid: str, ids: list[int], cached: int | None, logprobs: list | None, output_ids: list[int],
          finish: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                            "completion_tokens": len(output_ids)}
    if cached is not None:
        meta["cached_tokens"] = cached
    if logprobs is not None:
        meta["output_token_ids_logprobs"] = [logprobs]
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")
