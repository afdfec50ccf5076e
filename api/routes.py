"""HTTP routes: the System One evaluation (a synchronous facade over the queue), models, limits
and health."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.auth import queue_weight, tenant_of
from api.errors import ApiError, ClientDisconnected, DeadlineExceeded, JobFailed
from api.preparation import REQUEST_BODY_DOC, request_body
from api.queue_client import admission_of
from common.contract import ModelList, SystemOneRequest, SystemOneResponse
from common.jobs import JobOutcome, JobSpec, JobStatus, Lane
from common.queue.membership import Backlog, WorkerInfo
from common.queue.placement import Admission

router = APIRouter()


@router.post("/v1/systemone", response_model=SystemOneResponse, tags=["System One"],
             summary="Evaluate a state against named questions", openapi_extra=REQUEST_BODY_DOC)
async def systemone(request: Request,
                    body: SystemOneRequest = Depends(request_body)) -> Any:
    """Answers every question from label log-probabilities after one shared prompt prefix."""
    services = request.app.state.services
    started = time.perf_counter()
    services.preparer.check_request(body)
    job = await services.preparer.prepare_for(request, body, services.settings.request_timeout)
    prepare_seconds = time.perf_counter() - started
    request.state.job_id = job.id
    tenant = tenant_of(request.scope)
    queued = admission_of(tenant, job, Lane(body.x_priority or Lane.interactive), sync=True,
                          shared_weight=queue_weight(request.scope))
    outcome = await _run_unless_disconnected(request, job, queued)
    if outcome is None:
        await _end(request, job, JobStatus.expired, "timeout_error", "the request did not finish before its deadline",
                   504)
        raise DeadlineExceeded(f"no answer within {services.settings.request_timeout:g} s; the work was aborted")
    request.app.state.metrics.observe_acceptance(tenant.name, job.total_input_tokens)
    request.app.state.metrics.observe_delivery(outcome, prepare_seconds, tenant.name)
    if outcome.status is not JobStatus.succeeded or outcome.result is None:
        error = outcome.error or {"error_type": "api_error", "message": "the job ended without a result"}
        raise JobFailed(outcome.http_status or 500, error["error_type"], error["message"])
    return JSONResponse(outcome.result, headers=_result_headers(outcome, prepare_seconds))


async def _run_unless_disconnected(request: Request, job: JobSpec, admission: Admission) -> JobOutcome | None:
    """Submit the job and return its outcome; None past its deadline. A client that hangs up ends
    it as cancelled (499), once: ClientDisconnected carries that to the log and the metrics. The job is
    waited for in this request's own task; a watcher of the connection cancels that wait on a hang-up."""
    queue = request.app.state.services.queue
    route = asyncio.current_task()
    assert route is not None
    watching = True

    def on_hangup(watch: asyncio.Task[None]) -> None:
        if watching and not watch.cancelled() and watch.exception() is None:
            route.cancel()

    hangup = asyncio.create_task(_disconnected(request))
    hangup.add_done_callback(on_hangup)
    try:
        return await queue.run(job, job.remaining(), admission)
    except asyncio.CancelledError:
        if not (hangup.done() and not hangup.cancelled() and hangup.exception() is None):
            if request.app.state.stopping.is_set():  # the stopping server cut it short (api/middleware.py's 503)
                queue.end_soon(job.id, "the API stopped before this request was answered; send it again")
            raise
        route.uncancel()
    finally:
        watching = False
        hangup.cancel()
    await _end(request, job, JobStatus.cancelled, "cancelled", "the client disconnected", 499)
    raise ClientDisconnected("the client disconnected before the answer")


async def _end(request: Request, job: JobSpec, status: JobStatus, error_type: str, message: str,
               http_status: int) -> None:
    """End a job this route gives up on, counting the ending here if this call made it."""
    if await request.app.state.services.queue.cancel(job.id, status, error_type, message, http_status):
        request.app.state.metrics.observe_ending(status)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result_headers(outcome: JobOutcome, prepare_seconds: float) -> dict[str, str]:
    t = outcome.timings
    timing = ", ".join(f"{name};dur={seconds * 1000:.1f}" for name, seconds in (
        ("queue", t.queue), ("prepare", prepare_seconds), ("prefill", t.prefill), ("branches", t.branches)))
    headers = {"x-openjev-prefix-tokens": str(outcome.prefix_tokens), "x-openjev-attempts": str(outcome.attempts),
               "Server-Timing": timing}
    if outcome.cached_tokens is not None:
        headers["x-openjev-cached-tokens"] = str(outcome.cached_tokens)
    return headers


@router.get("/v1/models", response_model=ModelList, tags=["System One"], summary="List the served models")
async def models(request: Request) -> ModelList:
    settings = request.app.state.services.settings
    description = (f"openjev serving {settings.served_model_name}. Requests may name "
                   f"{settings.describe_accepted_models()}: all are answered by this model")
    return ModelList(models=[{"name": name, "description": description, "release_date": settings.model_release_date}
                             for name in settings.listed_model_names],
                     x_accepted_names=[settings.served_model_name, *settings.model_aliases])


@router.get("/v1/limits", tags=["Operations"], summary="The admission limits in force, and your tenant's own")
async def limits(request: Request) -> dict[str, Any]:
    """The server's limits, the queue, and the calling tenant's own limits and usage (no other tenant's)."""
    services = request.app.state.services
    s = services.settings
    return {
        "tenant": await _tenant_state(request),
        "max_questions": s.max_questions,
        "max_options": services.preparer.max_options,
        "max_input_tokens": s.max_input_tokens,
        "max_total_input_tokens": s.max_total_input_tokens,
        "max_body_bytes": s.max_body_bytes,
        "max_concurrent_requests_per_worker": s.max_concurrent_requests,
        "max_concurrent_branches_per_worker": s.max_concurrent_branches,
        "request_timeout_s": s.request_timeout,
        "job_timeout_s": s.job_timeout,
        **await _queue_state(request),
    }


async def _tenant_state(request: Request) -> dict[str, Any]:
    tenant = tenant_of(request.scope)
    limits = tenant.limits
    shared_weight = queue_weight(request.scope)
    state: dict[str, Any] = {
        "name": tenant.name, "weight": tenant.weight,
        "queue_share": round(tenant.weight / shared_weight, 6) if shared_weight else None,
        "limits": {"requests_per_minute": limits.requests_per_minute, "burst": limits.burst,
                   "max_concurrent_jobs": limits.max_concurrent_jobs, "max_queued_jobs": limits.max_queued_jobs}}
    try:
        usage = await request.app.state.services.queue.usage(tenant.name)
    except ApiError:
        return {**state, "usage": None}
    per_minute = limits.requests_per_minute
    state["usage"] = {"jobs": usage.jobs, "queued_or_running_async_jobs": usage.async_jobs,
                      "requests_remaining": None if per_minute is None else
                      max(0, (limits.burst or per_minute) - math.ceil(usage.rate_used_ms * per_minute / 60_000))}
    return state


async def _queue_state(request: Request) -> dict[str, Any]:
    """Queue depth and every heartbeating worker, engines down included (they take no jobs)."""
    try:
        members = await request.app.state.services.queue.fleet()
    except ApiError:
        return {"redis": "unreachable", "live_workers": 0, "queue_depth": None, "workers": []}
    return {
        "redis": "ok",
        "live_workers": sum(1 for w, _ in members if w.engine_ok),
        "queue_depth": sum(n for _, n in members),
        "workers": [{"id": w.id, "queue_depth": n, "engine_ok": w.engine_ok, "running": w.running, "model": w.model,
                     "heartbeat_age_s": round(time.time() - w.heartbeat_at, 3), "counters": w.counters.model_dump(),
                     "branch_hit_ratio": w.counters.branch_hit_ratio, "warm_hit_ratio": w.counters.warm_hit_ratio}
                    for w, n in members],
    }


@router.get("/health", tags=["Operations"], summary="Readiness: Redis reachable and a live worker")
async def health(request: Request) -> JSONResponse:
    services = request.app.state.services
    state = await _queue_state(request)
    ready = state["redis"] == "ok" and state["live_workers"] > 0
    body = {"status": "ok" if ready else "unavailable", "model": services.settings.served_model_name,
            "started_at": services.started_at, "uptime_s": round(time.time() - services.started_at, 3), **state}
    return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "5"})


@router.get("/metrics", tags=["Operations"], summary="Prometheus metrics (behind the API key when one is set)",
            response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    queue = request.app.state.services.queue

    async def fleet_and_backlog() -> tuple[list[tuple[WorkerInfo, int]], dict[str, Backlog]]:
        members = await queue.fleet()
        return members, await queue.backlog([w for w, _ in members])

    try:  # Redis's memory is read beside the fleet: two round trips one after the other, not three
        (members, backlog), memory = await asyncio.gather(fleet_and_backlog(),
                                                          queue.memory(shared=queue_weight(request.scope) > 0))
    except ApiError:
        return Response(request.app.state.metrics.render(None, {}), media_type=CONTENT_TYPE_LATEST)
    live = [w for w, _ in members if w.engine_ok]
    lengths = {w.id: n for w, n in members}
    return Response(request.app.state.metrics.render(live, lengths, backlog, memory), media_type=CONTENT_TYPE_LATEST)


@router.get("/health/live", tags=["Operations"], summary="Liveness: the process answers")
async def live() -> dict[str, str]:
    return {"status": "ok"}


