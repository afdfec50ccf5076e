"""A scripted engine at the HTTP boundary for fast worker and API tests: it speaks the same
`/generate` subset as SGLang and the CPU engine, with logprobs derived from a hash of the prompt,
and can be told to stall or fail. Never the only test of a path: the CPU engine covers the real one.

Run: python -m tests.scripted_engine --port P
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


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
        self.register_delay = 0.0  # seconds before a call can be aborted; an earlier abort is dropped (SGLang's
        #                            Python frontend answers it 200 and the call runs to completion)
        self.report_cached = True  # False imitates an engine without cached_tokens (0.5.19's Rust frontend)
        self.healthy = True
        self.health_delay = 0.0  # seconds the health route takes to answer


def create_app() -> FastAPI:
    app = FastAPI()
    script = Script()
    stats = {"requests_received": 0, "requests_finished": 0, "requests_aborted": 0, "aborts_received": 0,
             "prompt_tokens": 0, "cached_tokens": 0}
    live: dict[str, asyncio.Event] = {}
    received: list[str] = []  # rids in arrival order
    finished: list[str] = []  # rids answered with logprobs, in order
    aborted_rids: list[str] = []  # rids ended by an abort request, in order
    seen = PrefixTrie()

    @app.post("/script")
    async def set_script(body: dict[str, Any]) -> dict[str, Any]:
        for key, value in body.items():
            setattr(script, key, value)
        return vars(script)

    @app.get("/stats")
    async def get_stats() -> dict[str, Any]:
        return {**stats, "live": sorted(live), "received": received, "finished": finished, "aborted": aborted_rids}

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
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        rid = body["rid"]
        ids = body["input_ids"]
        stats["requests_received"] += 1
        received.append(rid)
        if script.fail_rid_suffix and rid.endswith(script.fail_rid_suffix):
            await asyncio.sleep(script.fail_delay)
            failure = script.fail_body if script.fail_body is not None else {"object": "error",
                                                                              "message": "scripted failure"}
            return JSONResponse(failure, status_code=script.fail_status)
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
                return JSONResponse(_meta(rid, ids, 0, None, [], {"type": "abort", "message": "aborted"}))
        finally:
            live.pop(rid, None)
        cached = min(seen.insert(ids), len(ids) - 1)
        stats["requests_finished"] += 1
        finished.append(rid)
        stats["prompt_tokens"] += len(ids)
        stats["cached_tokens"] += cached
        labels = body.get("token_ids_logprob") or []
        logprobs = [[_logprob(ids, t), t, None] for t in labels]
        return JSONResponse(_meta(rid, ids, cached if script.report_cached else None, logprobs,
                                  [], {"type": "length", "length": 1}))

    return app


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
