"""Client strings quoted back in error messages are cut to a short prefix: a 1 MiB model name, job id,
duplicate key, chat role or Content-Encoding is not sent back whole. In-process: no boundary matters."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from api.app import Services, create_app
from api.jobs import _missing
from api.preparation import JobPreparer
from common.contract import ECHO_CHARS, echo
from common.prompt import PromptCompiler
from common.settings import Settings

HUGE = "m" * (1024 * 1024)
SHORT = 4 * ECHO_CHARS + 400  # bytes an error body may take beside the quoted prefix


@pytest_asyncio.fixture(loop_scope="function")
async def client(smollm2_compiler: PromptCompiler) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    app = create_app(settings)
    # Only what the refusals below reach: no route gets as far as the queue.
    preparer = JobPreparer(settings, smollm2_compiler)
    app.state.services = Services(settings, preparer, None, time.time())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        yield http


def request_body(**fields: object) -> dict:
    return {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}, **fields}


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/jobs"])
async def test_a_huge_model_name_is_echoed_as_a_short_prefix(client: httpx.AsyncClient, path: str) -> None:
    r = await client.post(path, json=request_body(model=HUGE))
    assert r.status_code == 400
    message = r.json()["detail"]["message"]
    assert message.startswith(f"Unknown model: {'m' * ECHO_CHARS}…. This server accepts ")
    assert "m" * (ECHO_CHARS + 1) not in message
    assert len(r.content) < SHORT


async def test_a_huge_duplicate_key_is_echoed_as_a_short_prefix(client: httpx.AsyncClient) -> None:
    key = json.dumps(HUGE[:900 * 1024])  # twice, within the body limit
    raw = '{"model": "jev-latest", "state": {' + f"{key}: 1, {key}: 2" + '}, "questions": {"q": {"type": "noul"}}}'
    r = await client.post("/v1/systemone", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert len(r.json()["detail"][0]["msg"]) < SHORT


async def test_a_huge_chat_role_is_echoed_as_a_short_prefix(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/systemone", json=request_body(state=[{"role": HUGE, "content": "hi"}]))
    assert r.status_code == 422
    assert "…" in r.json()["detail"][0]["msg"] and len(r.json()["detail"][0]["msg"]) < SHORT


async def test_a_long_content_encoding_is_echoed_as_a_short_prefix(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/systemone", content=b"{}", headers={"Content-Type": "application/json",
                                                                  "Content-Encoding": "x" * 20000})
    assert r.status_code == 415
    assert len(r.content) < SHORT


def test_a_huge_job_id_is_echoed_as_a_short_prefix() -> None:
    for created in (None, time.time()):
        assert len(_missing("job_" + "f" * 100000, created, 3600).message) < SHORT


def test_echo_keeps_short_strings_and_writes_lone_surrogates_out() -> None:
    assert echo("jev-latest") == "jev-latest"
    assert echo("x" * (ECHO_CHARS + 1)) == "x" * ECHO_CHARS + "…"
    assert echo("\udfff") == "\\udfff"


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/jobs"])
async def test_the_body_is_parsed_once_and_validated_from_that_value(client: httpx.AsyncClient, path: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """BodyGate's strict reader parses the body; the route validates the value it left (api/preparation.py,
    `request_body`). FastAPI's own parse (Starlette's `Request.json`) never runs, and the 422 keeps its shape."""
    from starlette.requests import Request

    import api.middleware

    parses: list[bytes] = []
    strict = api.middleware.read_json

    def counted(raw: bytes) -> object:
        parses.append(raw)
        return strict(raw)

    async def refused(self: Request) -> object:
        raise AssertionError("the body was parsed a second time")

    monkeypatch.setattr(api.middleware, "read_json", counted)
    monkeypatch.setattr(Request, "json", refused)
    r = await client.post(path, json=request_body(questions={"q": {"type": "bogus"}}))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][:3] == ["body", "questions", "q"]
    assert len(parses) == 1
    r = await client.post(path, content=b"null", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["detail"] == [{"loc": ["body"], "msg": "Field required", "type": "missing"}]
