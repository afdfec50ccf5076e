"""The OpenAPI schema as this server, with its settings, really accepts and answers: the model names
and limits in force, the key when one is set, and every status a route can answer with, so a
schema-driven client or fuzzer finds no difference between the two."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from api.auth import SUBMISSIONS, is_protected
from common.contract import INTEGER_RANGE, SystemOneRequest
from common.settings import Settings

BEARER = "bearer"
"""The security scheme's name in `components.securitySchemes`."""

_ERROR = {"$ref": "#/components/schemas/ErrorBody"}
_JOB = {"$ref": "#/components/schemas/JobView"}
_VALIDATION = {"$ref": "#/components/schemas/HTTPValidationError"}
_REQUEST_ID = {"x-typesafe-request-id": {"description": "`req_<hex>`, on every response",
                                         "schema": {"type": "string", "pattern": "^req_[0-9a-f]+$"}}}

# Statuses any body-carrying route can answer before the route itself runs (api/middleware.py).
_BODY_GATE = {
    400: "Unknown model, or a body that is not valid UTF-8, gzip or zstd (one member or frame, nothing after it)",
    408: "The body did not arrive within OPENJEV_BODY_TIMEOUT",
    413: "Body over the size limit (after decompression)",
    415: "Unsupported Content-Encoding",
}
_AUTH = {401: "Wrong API key", 403: "Missing API key"}
_QUEUE_DOWN = {503: "No live worker yet, or the job queue is unreachable or full; see Retry-After"}
_SYNC_QUEUE_DOWN = {503: "No live worker yet, the job queue is unreachable or full, or it lost this request's job "
                         "(its Redis restarted): see Retry-After, then send the request again"}
_JOB_GONE = {404: "Unknown job, or its result expired",
             410: "The job was accepted and should still be kept, but the queue lost it: submit it again"}
_EXTRA: dict[tuple[str, str], dict[int, str]] = {
    ("post", "/v1/systemone"): {422: "Validation Error", **_BODY_GATE, **_SYNC_QUEUE_DOWN,
                                502: "The engine failed or answered something that cannot be trusted",
                                504: "Deadline exceeded", 529: "Overloaded; see Retry-After"},
    ("post", "/v1/jobs"): {**_BODY_GATE, **_QUEUE_DOWN, 529: "Overloaded; see Retry-After",
                           200: "An idempotent replay: the job this Idempotency-Key already holds, as it stands now",
                           409: "This Idempotency-Key was used with a different body"},
    ("get", "/v1/jobs/{job_id}"): {**_QUEUE_DOWN, **_JOB_GONE},
    ("delete", "/v1/jobs/{job_id}"): {**_QUEUE_DOWN, **_JOB_GONE},
    ("get", "/v1/limits"): _QUEUE_DOWN,
    ("get", "/health"): {503: "Not ready: Redis unreachable or no live worker; see Retry-After"},
}


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve `openapi_schema(app, settings)` at /openapi.json (built once, on first use)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, settings)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def openapi_schema(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's schema of the routes, completed with what the settings and the middleware decide."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _request_components(schema["components"]["schemas"])
    _limit_request(schema["components"]["schemas"], settings)
    if _keyed(settings):
        schema["components"]["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            _complete(operation, method, path, settings)
    return schema


def _keyed(settings: Settings) -> bool:
    return settings.api_key is not None or settings.api_keys_file is not None


def _request_components(components: dict[str, Any]) -> None:
    """The request body's models, as FastAPI writes a body parameter's: the routes read the body through a
    dependency (api/preparation.py, `request_body`) and name it in `openapi_extra`, so FastAPI leaves them out."""
    request = TypeAdapter(SystemOneRequest).json_schema(ref_template="#/components/schemas/{model}", mode="validation")
    for name, definition in [*request.pop("$defs", {}).items(), (SystemOneRequest.__name__, request)]:
        for field in definition.get("properties", {}).values():
            if "default" in field and field["default"] is None:
                del field["default"]  # as FastAPI writes an optional field: no `"default": null`
        components.setdefault(name, definition)


def _limit_request(components: dict[str, Any], settings: Settings) -> None:
    request = components["SystemOneRequest"]["properties"]
    request["model"] = _model_names(settings)
    request["questions"]["maxProperties"] = settings.max_questions
    components["ChoiceQuestion"]["properties"]["criteria"]["maxProperties"] = settings.max_options
    components["ScoreQuestion"]["properties"]["criteria"]["maxItems"] = settings.max_options
    for name in ("ScoreLevel", "EchoedJson"):
        for choice in components[name]["anyOf"]:
            if choice.get("type") == "integer":  # FastAPI writes the bounds as floats, which round past them
                choice["minimum"], choice["maximum"] = INTEGER_RANGE


def _model_names(settings: Settings) -> dict[str, Any]:
    exact = [name for name in [settings.served_model_name, *settings.model_aliases] if not name.endswith("*")]
    patterns = [f"^{_regex_literal(name[:-1])}" for name in settings.model_aliases if name.endswith("*")]
    choices: list[dict[str, Any]] = [{"type": "string", "enum": sorted(set(exact))}]
    choices += [{"type": "string", "pattern": pattern} for pattern in patterns]
    return {"title": "Model", "description": "The served model's name, an alias from OPENJEV_MODEL_ALIASES, or a "
            "name one of its `prefix*` patterns begins; the response names the served model",
            "examples": ["jev-latest"], "anyOf": choices}


def _regex_literal(text: str) -> str:
    # JSON Schema patterns are ECMA-262 regexes: escape their syntax characters, and only those.
    return "".join(f"\\{c}" if c in "^$\\.*+?()[]{}|/" else c for c in text)


def _complete(operation: dict[str, Any], method: str, path: str, settings: Settings) -> None:
    responses = operation.setdefault("responses", {})
    extra = dict(_EXTRA.get((method, path), {}))
    if _keyed(settings) and is_protected(path):
        operation["security"] = [{BEARER: []}]
        extra |= _AUTH
    if settings.api_keys_file is not None and method == "post" and path in SUBMISSIONS:
        extra[429] = ("The tenant is at one of its limits (keys file), or holds more than its weight's share of the "
                      "async jobs in Redis (queued, or ended and kept) while the queue's Redis nears its maxmemory; "
                      "see Retry-After")
    for status, description in extra.items():
        body = _VALIDATION if status == 422 else _JOB if status == 200 else _ERROR
        responses[str(status)] = {"description": description, "content": {"application/json": {"schema": body}}}
    for response in responses.values():
        response.setdefault("headers", {}).update(_REQUEST_ID)
