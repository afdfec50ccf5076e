"""A newcomer's first requests, answered or refused out loud: what the served model cannot read (images,
`box` questions, typesafe-sdk's multipart body), the model names it accepts, and the usual mistakes
(a base URL ending in /v1, POST /, a body without its Content-Type). In-process: the app's real
middleware, validation and error mapping through httpx's ASGI transport, with no queue behind it."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator

import httpx
import httpx2
import pytest
import pytest_asyncio
from fastapi import FastAPI
from typesafe_sdk import AsyncTypeSafeClient, Box, Image, TypeSafeUnprocessableEntityError

from api.app import Services
from api.app import create_app as create_api
from api.preparation import JobPreparer
from common.prompt import PromptCompiler
from common.settings import Settings
from common.tokenizer import qwen36_tokenizer

NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=")


def body(**fields) -> dict:
    return {"model": "jev-latest", "state": "I was charged twice.", "questions": {"refund": NOUL}, **fields}


@pytest.fixture(scope="module")
def compiler() -> PromptCompiler:
    return PromptCompiler.for_tokenizer(qwen36_tokenizer())


def build_app(compiler: PromptCompiler, **settings) -> FastAPI:
    """The API as `openjev api` builds it; its lifespan (Redis, the queue) is not run, so a request that
    got past validation and the model check would fail on the missing queue, never answer 200."""
    s = Settings(**settings)
    app = create_api(s)
    app.state.services = Services(settings=s, preparer=JobPreparer(s, compiler), queue=None,  # type: ignore[arg-type]
                                  started_at=time.time())
    return app


@pytest_asyncio.fixture
async def client(compiler: PromptCompiler) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(compiler), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://openjev") as c:
        yield c


def refusal(r: httpx.Response, status: int) -> list | dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["x-typesafe-request-id"].startswith("req_")
    return r.json()["detail"]


# --- what the served model cannot read --------------------------------------------------------------


async def test_assets_are_refused_naming_the_field_and_that_the_model_reads_text_only(client) -> None:
    assets = {"<img1>": {"type": "image", "format": "png", "data_base64": base64.b64encode(PNG).decode()}}
    detail = refusal(await client.post("/v1/systemone", json=body(state="What is in <img1>?", assets=assets)), 422)
    assert detail[0]["loc"] == ["body", "assets"]
    assert "reads text only" in detail[0]["msg"] and detail[0]["type"] == "text_only"
    detail = refusal(await client.post("/v1/jobs", json=body(assets={})), 422)
    assert detail[0]["loc"] == ["body", "assets"]


async def test_a_null_assets_field_is_no_image_and_is_not_refused(client) -> None:
    # Past validation and the model check the request reaches the (absent) queue: a 500 here, not a 422.
    r = await client.post("/v1/systemone", json=body(assets=None))
    assert r.status_code == 500, r.text


async def test_a_box_question_is_refused_as_needing_an_image_not_as_an_unknown_type(client) -> None:
    questions = {"refund": NOUL, "where": {"type": "box", "instructions": "the receipt"}}
    detail = refusal(await client.post("/v1/systemone", json=body(questions=questions)), 422)
    assert detail == [{"loc": ["body", "questions", "where", "type"], "type": "text_only", "msg": detail[0]["msg"]}]
    assert "reads text only" in detail[0]["msg"] and "unknown" not in detail[0]["msg"].lower()
    detail = refusal(await client.post("/v1/systemone", json=body(questions={"q": {"type": "rank"}})), 422)
    assert "'rank'" in detail[0]["msg"]  # other unknown types keep pydantic's message


async def sdk_client(compiler: PromptCompiler) -> AsyncTypeSafeClient:
    transport = httpx2.ASGITransport(app=build_app(compiler))
    return AsyncTypeSafeClient(api_key="k", base_url="http://openjev", transport=transport, retry=None)


async def test_typesafe_sdk_images_get_the_text_only_refusal(compiler: PromptCompiler) -> None:
    image = Image(PNG)
    async with await sdk_client(compiler) as sdk:
        with pytest.raises(TypeSafeUnprocessableEntityError) as raised:
            await sdk.system_one(state=["What does this show?", image], questions={"refund": NOUL})
        with pytest.raises(TypeSafeUnprocessableEntityError) as boxed:
            await sdk.system_one(state="a receipt", questions={"where": Box(instructions="the total")})
    assert "reads text only" in str(raised.value) and "valid dictionary" not in str(raised.value)
    assert "reads text only" in str(boxed.value)


async def test_a_multipart_body_with_unnamed_image_parts_is_refused(client) -> None:
    files = {"request": (None, json.dumps(body()), "application/json"), "asset-0": ("a.png", PNG, "image/png")}
    detail = refusal(await client.post("/v1/systemone", files=files), 422)
    assert detail[0]["loc"] == ["body", "assets"] and "reads text only" in detail[0]["msg"]


async def test_a_multipart_body_without_images_is_read_as_its_request_part(client) -> None:
    files = {"request": (None, json.dumps(body(model="gpt-4o")), "application/json")}
    assert "Unknown model: gpt-4o" in refusal(await client.post("/v1/systemone", files=files), 400)["message"]
    detail = refusal(await client.post("/v1/systemone", files={"other": (None, b"{}", "application/json")}), 422)
    assert "part named `request`" in detail[0]["msg"]


# --- model names --------------------------------------------------------------------------------------


async def test_unknown_model_names_the_accepted_names_and_the_alias_rule(client) -> None:
    message = refusal(await client.post("/v1/systemone", json=body(model="gpt-4o")), 400)["message"]
    assert message.startswith("Unknown model: gpt-4o")
    for words in ("Qwen/Qwen3.6-35B-A3B", "jev-latest", "any name beginning `jev-`", "jev-1.13.0", "/v1/models"):
        assert words in message, (words, message)


async def test_models_list_names_the_alias_rule(client) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    doc = r.json()
    assert [m["name"] for m in doc["models"]] == ["Qwen/Qwen3.6-35B-A3B", "jev-latest"]
    assert all("jev-1.13.0" in m["description"] for m in doc["models"])
    assert doc["x_accepted_names"] == ["Qwen/Qwen3.6-35B-A3B", "jev-*"]


async def test_narrowed_aliases_are_named_exactly(compiler: PromptCompiler) -> None:
    app = build_app(compiler, model_aliases="jev-latest,jev-1.13.0")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://openjev") as c:
        message = refusal(await c.post("/v1/systemone", json=body(model="jev-preview")), 400)["message"]
        assert "`jev-1.13.0`" in message and "beginning" not in message
        assert (await c.get("/v1/models")).json()["x_accepted_names"] == ["Qwen/Qwen3.6-35B-A3B", "jev-latest",
                                                                          "jev-1.13.0"]


# --- the usual mistakes -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/v1/systemone", "/v1/v1/models"])
async def test_a_base_url_ending_in_v1_gets_a_404_naming_the_right_path(client, path: str) -> None:
    r = await client.post(path, json=body()) if path.endswith("systemone") else await client.get(path)
    detail = refusal(r, 404)
    assert detail["error_type"] == "not_found_error"
    assert f"the route is {path[3:]}" in detail["message"] and "server root" in detail["message"]


@pytest.mark.parametrize("path", ["/v1", "/v1/"])
async def test_v1_alone_gets_a_404_listing_the_routes(client, path: str) -> None:
    detail = refusal(await client.get(path), 404)
    assert "POST /v1/systemone" in detail["message"] and "GET /v1/models" in detail["message"]


async def test_post_to_the_root_says_where_to_post(client) -> None:
    r = await client.post("/", json=body())
    detail = refusal(r, 405)
    assert r.headers["allow"] == "GET"
    assert "POST evaluations to /v1/systemone" in detail["message"]


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
async def test_a_body_that_is_not_declared_json_is_told_to_send_the_content_type(client, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = await client.post("/v1/systemone", content=json.dumps(body()).encode(), headers=headers)
    assert "content-type" not in r.request.headers or content_type
    detail = refusal(r, 415)
    assert "`Content-Type: application/json`" in detail["message"]
    assert "valid dictionary" not in detail["message"]
    assert ("curl's default" in detail["message"]) == (content_type == "application/x-www-form-urlencoded")


# --- metrics --------------------------------------------------------------------------------------------


async def test_refusals_before_routing_are_counted_under_their_real_route(compiler: PromptCompiler) -> None:
    app = build_app(compiler, api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://openjev") as c:
        assert (await c.post("/v1/systemone", json=body())).status_code == 403
        assert (await c.post("/v1/systemone", json=body(), headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await c.get("/v1/jobs/job_x", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await c.get("/nowhere")).status_code == 404

    def count(route: str, status: str) -> float | None:
        return app.state.metrics.registry.get_sample_value("openjev_requests_total", {"route": route, "status": status})

    assert count("/v1/systemone", "403") == 1 and count("/v1/systemone", "401") == 1
    assert count("/v1/jobs/{job_id}", "401") == 1
    assert count("unmatched", "404") == 1 and count("unmatched", "403") is None
