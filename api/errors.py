"""The one mapping from domain errors to HTTP statuses and the contract's error shapes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from api.strict_json import printable
from common.contract import BOX_REFUSED, echo
from common.redis_connection import out_of_memory


def error_body(error_type: str, message: str) -> bytes:
    """The contract's error envelope, the one place it is written: every refusal, from the front door's
    (api/front_door.py) to a route's, carries this body."""
    return orjson.dumps({"detail": {"error_type": error_type, "message": message}})


def error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(error_type, message), status_code=status, headers=headers,
                    media_type="application/json")


async def send_json(send: Callable[[MutableMapping[str, Any]], Awaitable[None]], status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer from ASGI middleware (before or outside the app's routes) with a JSON body."""
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class ApiError(Exception):
    """An error answered as `{"detail": {"error_type", "message"}}` with `status`. A subclass names its
    own in its class line: `class Overloaded(ApiError, status=529, error_type="overloaded_error")`."""

    status = 500
    error_type = "api_error"

    def __init_subclass__(cls, status: int | None = None, error_type: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if error_type is not None:
            cls.error_type = error_type

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def response(self) -> Response:
        return error_response(self.status, self.error_type, self.message, self.headers)

    async def send_to(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        """Answer with this error from ASGI middleware."""
        await send_json(send, self.status, error_body(self.error_type, self.message),
                        [(name.lower().encode(), value.encode()) for name, value in self.headers.items()])


class UnknownModel(ApiError, status=400, error_type="api_usage_error"):
    def __init__(self, name: str, accepted: str) -> None:
        super().__init__(f"Unknown model: {echo(name)}. This server accepts {accepted}; GET /v1/models lists them")


class AuthenticationError(ApiError, error_type="authentication_error"):
    """The request's API key is missing or wrong."""


class MissingKey(AuthenticationError, status=403):
    """No API key was sent."""


class WrongKey(AuthenticationError, status=401):
    """The API key sent is not one this server knows."""


class NoWorker(ApiError, status=503, error_type="unavailable_error"):
    """No worker has a fresh heartbeat and a healthy engine: nothing could run the job."""


class QueueUnavailable(ApiError, status=503, error_type="unavailable_error"):
    def __init__(self) -> None:
        super().__init__("the job queue is unreachable; retry shortly", {"Retry-After": "2"})


class QueueFull(ApiError, status=503, error_type="unavailable_error"):
    """The queue's Redis is at its maxmemory (noeviction), or within the headroom kept below it for the jobs it
    holds (OPENJEV_REDIS_HEADROOM): it takes no new job until finished jobs' keys expire or its limit is
    raised; the jobs it holds still run."""

    def __init__(self) -> None:
        super().__init__("the job queue is full (its Redis is at its maxmemory, less the room kept for the jobs it "
                         "holds) and takes no new jobs; retry shortly", {"Retry-After": "5"})


def queue_error(error: BaseException) -> ApiError:
    """The 503 for a Redis error: full, or unreachable (restarting, failing over, cut off)."""
    return QueueFull() if out_of_memory(error) else QueueUnavailable()


class SyncJobLost(ApiError, status=503, error_type="unavailable_error"):
    """A sync request's job vanished from the queue while its caller waited (its Redis restarted
    without it, or lost its data): nothing will answer it, and sending it again is safe."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the queue lost this request's job ({job_id}) before it was answered (its Redis "
                         "restarted without it); send the request again", {"Retry-After": "1"})


class TenantLimited(ApiError, status=429, error_type="rate_limit_error"):
    """The tenant is at one of its limits (common/tenants.py), or holds more than its weight's share of the async
    jobs in Redis (queued, or ended and kept) while the queue's Redis nears its maxmemory (`limit` "queue_share");
    other tenants are unaffected. Counted in `openjev_tenant_limited_total` by tenant and limit."""

    def __init__(self, message: str, headers: dict[str, str], tenant: str, limit: str) -> None:
        super().__init__(message, headers)
        self.tenant = tenant
        self.limit = limit


class Overloaded(ApiError, status=529, error_type="overloaded_error"):
    """No worker could finish the job before its deadline."""


class DeadlineExceeded(ApiError, status=504, error_type="timeout_error"):
    """The job did not end before its deadline."""


class ClientDisconnected(ApiError, status=499, error_type="cancelled"):
    """The client hung up before its answer: nobody reads the response, but logs and metrics say 499."""


class JobNotFound(ApiError, status=404, error_type="not_found_error"):
    """No job of this tenant has this id (or it ended longer ago than its record is kept)."""


class JobLost(ApiError, status=410, error_type="job_lost_error"):
    """The job was accepted and its record should still be kept, but Redis no longer has it."""


class JobFailed(ApiError):
    """A job ended without a result; the worker chose the status and the error."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


def invalid(loc: list[str | int], message: str, kind: str = "value_error") -> RequestValidationError:
    """A 422 in FastAPI's shape for a check made after parsing (limits, budgets, content)."""
    return RequestValidationError([{"loc": ["body", *loc], "msg": message, "type": kind}])


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to the contract's shapes."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        request.state.error_type = exc.error_type
        if isinstance(exc, TenantLimited):
            request.app.state.metrics.observe_refusal(exc.tenant, exc.limit)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": [printable(step) if isinstance(step, str) else step for step in e["loc"]],
                   "msg": printable(str(e["msg"])), "type": e["type"]} for e in map(_text_only, exc.errors())]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    @app.exception_handler(RedisError)
    async def _queue_down(request: Request, exc: RedisError) -> Response:
        # Any route that reaches Redis while it restarts: a fast 503, never a 500 (middleware that
        # reaches Redis before a route answers the same, api/auth.py); a full Redis's says so.
        unavailable = queue_error(exc)
        request.state.error_type = unavailable.error_type
        return unavailable.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        headers = dict(exc.headers or {})
        allowed = allowed_methods(request) if exc.status_code == 405 else None
        if allowed:
            headers["Allow"] = allowed
        message = _wrong_path(request.scope["path"], request.method, exc.status_code) or str(exc.detail)
        return error_response(exc.status_code, kind, message, headers)


ROUTES_IN_WORDS = "POST /v1/systemone (evaluate), GET /v1/models, POST /v1/jobs (async); the API reference is at GET /"


def _wrong_path(path: str, method: str, status: int) -> str | None:
    """What to do instead, for the paths clients are commonly pointed at by mistake."""
    if status == 404 and (path == "/v1/v1" or path.startswith("/v1/v1/")):
        return (f"no route at {path}: the base URL ends in /v1, and the client adds /v1 itself. Point it at the "
                f"server root (TYPESAFE_BASE_URL=http://host:port); the route is {path[3:]}")
    if status == 404 and path in ("/v1", "/v1/"):
        return f"{path} is not a route. The routes: {ROUTES_IN_WORDS}; clients take the server root as base URL"
    if status == 405 and path == "/" and method == "POST":
        return ("POST evaluations to /v1/systemone (a client's base URL is the server root; it adds the path). "
                "GET / is the API reference page")
    return None


def _text_only(error: dict) -> dict:
    """A `box` question (the official API's bounding boxes) is refused as what it is, not as an unknown type."""
    if error["type"] == "union_tag_invalid" and error.get("ctx", {}).get("tag") == "box":
        return {"loc": [*error["loc"], "type"], "msg": BOX_REFUSED, "type": "text_only"}
    return error


def allowed_methods(request: Request) -> str | None:
    """The methods the schema declares at this path (Starlette names only the first route that matched)."""
    for template, operations in request.app.openapi()["paths"].items():
        pattern, _, _ = compile_path(template)
        if pattern.match(request.scope["path"]):
            return ", ".join(sorted(method.upper() for method in operations))
    return None
