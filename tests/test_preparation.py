"""Where a request is prepared (rendered, tokenized, budgeted): a small body on the event loop, where a
worker thread's hand-off would cost more than the work (issue 29), a larger one in a worker thread, so that
the loop never waits on a long state. Either way the job is the same."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from starlette.requests import Request

from api.preparation import INLINE_PREPARE_BYTES, JobPreparer
from common.contract import EXAMPLE_REQUEST, SystemOneRequest
from common.prompt import PromptCompiler
from common.settings import Settings


def http_request(content_length: str | None) -> Request:
    headers = [] if content_length is None else [(b"content-length", content_length.encode())]
    return Request({"type": "http", "method": "POST", "headers": headers, "state": {"request_id": "req_1"}})


@pytest.mark.parametrize(("content_length", "on_loop"), [
    (str(INLINE_PREPARE_BYTES), True), (str(INLINE_PREPARE_BYTES + 1), False), (None, False), ("12x", False)])
async def test_small_bodies_are_prepared_on_the_loop_and_larger_ones_in_a_thread(
        smollm2_compiler: PromptCompiler, content_length: str | None, on_loop: bool) -> None:
    preparer = JobPreparer(Settings(_env_file=None), smollm2_compiler)  # type: ignore[call-arg]
    threads: list[int] = []
    prepare = preparer.prepare

    def recorded(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return prepare(*args)

    preparer.prepare = recorded  # type: ignore[method-assign]
    body = SystemOneRequest.model_validate(EXAMPLE_REQUEST)
    job = await preparer.prepare_for(http_request(content_length), body, 30.0)
    assert (threads == [threading.get_ident()]) is on_loop and len(threads) == 1
    reference = prepare(body, "req_1", 30.0)
    assert job.request_id == "req_1"
    assert job.prefix_ids == reference.prefix_ids
    assert [b.suffix_ids for b in job.branches] == [b.suffix_ids for b in reference.branches]
