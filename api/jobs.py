"""Async jobs: submit an evaluation and come back for it. `POST /v1/jobs` answers 202 with a job
id at once; `GET /v1/jobs/{id}?wait=S` long-polls for the outcome; `DELETE` cancels."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, JobLost, JobNotFound
from common import keys
from common.contract import EXAMPLE_REQUEST, ErrorBody, ErrorDetail, SystemOneRequest
from common.jobs import JobStatus, job_created_at
from common.jobstore import JobRecord

router = APIRouter(tags=["Async jobs"])

MAX_WAIT = 30.0  # seconds a GET may hold the request open
CLOCK_SLACK = 5.0  # seconds the API replicas' clocks may disagree about a job id's creation time


class JobView(BaseModel):
    """An async job as clients see it."""

    id: str = Field(description="Unguessable job id")
    status: JobStatus
    created_at: str = Field(description="RFC 3339, UTC")
    deadline_at: str = Field(description="RFC 3339, UTC; past it the job is `expired`")
    result: dict[str, Any] | None = Field(
        default=None, description="When `succeeded`: exactly the body /v1/systemone returns (SystemOneResponse)")
    error: ErrorDetail | None = Field(default=None, description="When failed, cancelled or expired")


class IdempotencyConflict(ApiError):
    status = 409
    error_type = "idempotency_error"


@router.post("/v1/jobs", status_code=202, response_model=JobView,
             summary="Submit an evaluation to run in the background")
async def submit_job(request: Request, response: Response,
                     body: SystemOneRequest = Body(openapi_examples={"ticket": {"value": EXAMPLE_REQUEST}}),
                     idempotency_key: str | None = Header(default=None, max_length=200,
                                                          description="Retries with the same key get the same job")
                     ) -> Any:
    """Validates exactly like `/v1/systemone` (same 4xx before anything is queued), then queues the job."""
    services = request.app.state.services
    services.preparer.check_request(body)
    job = await run_in_threadpool(services.preparer.prepare, body, request.state.request_id,
                                  services.settings.job_timeout)
    request.state.job_id = job.id
    if idempotency_key is not None:
        existing = await _claim_idempotency(request, idempotency_key, job.id, body)
        if existing is not None:
            return _located(response, _view(existing), status=200)
    try:
        await services.queue.submit(job)
    except ApiError:
        if idempotency_key is not None:
            await services.redis.delete(keys.idempotency_key(idempotency_key))
        raise
    record = await services.queue.store.get(job.id)
    return _located(response, _view(record), status=202)


@router.get("/v1/jobs/{job_id}", response_model=JobView, response_model_exclude_none=True,
            responses={404: {"model": ErrorBody, "description": "Unknown job, or its result expired"},
                       410: {"model": ErrorBody, "description": "The job was accepted and its result should still "
                             "be kept, but the queue lost it (its Redis lost data): submit the request again"}},
            summary="Read a job, optionally waiting for it to finish")
async def get_job(request: Request, job_id: str,
                  wait: float = Query(default=0.0, ge=0.0, le=MAX_WAIT,
                                      description=f"Seconds to hold the request until the job ends (≤ {MAX_WAIT:g})")
                  ) -> Any:
    queue = request.app.state.services.queue
    record = await _record(request, job_id)
    if not record.status.terminal and wait > 0:
        await queue.wait(job_id, min(wait, max(0.0, record.deadline_at - time.time()) + 1.0))
        record = await _record(request, job_id)
    return _view(await _expire_if_overdue(request, record))


@router.delete("/v1/jobs/{job_id}", response_model=JobView, response_model_exclude_none=True, summary="Cancel a job")
async def cancel_job(request: Request, job_id: str) -> Any:
    """Ends a queued or running job as `cancelled` and aborts its engine calls; a finished job is unchanged."""
    queue = request.app.state.services.queue
    await _record(request, job_id)
    await queue.cancel(job_id, JobStatus.cancelled, "cancelled", "the job was cancelled by its owner", 499)
    return _view(await _record(request, job_id))


async def _record(request: Request, job_id: str) -> JobRecord:
    services = request.app.state.services
    record = await services.queue.store.get(job_id)
    if record is None:
        raise _missing(job_id, services.settings.job_result_ttl)
    return record


def _missing(job_id: str, result_ttl: int) -> ApiError:
    """Why `job_id` has no record. Every record lives at least the result TTL from its job's
    creation (a finished job's for the TTL after it ended), so a missing one younger than that was lost."""
    created = job_created_at(job_id)
    if created is not None and created - CLOCK_SLACK <= time.time() < created + result_ttl - CLOCK_SLACK:
        return JobLost(f"job {job_id!r} was accepted at {_rfc3339(created)} and would still be kept, but the queue "
                       "has lost it (its Redis lost data); submit the request again")
    return JobNotFound(f"no job {job_id!r} (unknown, or its result expired)")


async def _expire_if_overdue(request: Request, record: JobRecord) -> JobRecord:
    """A job still pending well past its deadline (its worker vanished) is reported, and recorded, as expired."""
    if record.status.terminal or time.time() < record.deadline_at + 5.0:
        return record
    queue = request.app.state.services.queue
    await queue.cancel(record.id, JobStatus.expired, "timeout_error", "the job did not finish before its deadline", 504)
    return await _record(request, record.id)


async def _claim_idempotency(request: Request, key: str, job_id: str, body: SystemOneRequest) -> JobRecord | None:
    """Reserve `key` for `job_id`; if a job already holds it, return that job (409 if the body differs)."""
    services = request.app.state.services
    digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()[:32]
    redis_key = keys.idempotency_key(key)
    ttl = int(services.settings.job_timeout) + services.settings.job_result_ttl
    if await services.redis.set(redis_key, f"{job_id}:{digest}", nx=True, ex=ttl):
        return None
    held = (await services.redis.get(redis_key) or b"").decode()
    held_id, _, held_digest = held.partition(":")
    if held_digest != digest:
        raise IdempotencyConflict("this Idempotency-Key was already used with a different request body")
    return await services.queue.store.get(held_id) or await _record(request, held_id)


def _view(record: JobRecord | None) -> JobView:
    assert record is not None
    outcome = record.outcome
    return JobView(
        id=record.id,
        status=record.status,
        created_at=_rfc3339(record.created_at),
        deadline_at=_rfc3339(record.deadline_at),
        result=outcome.result if outcome and outcome.status is JobStatus.succeeded else None,
        error=outcome.error if outcome and outcome.status is not JobStatus.succeeded else None,
    )


def _located(response: Response, view: JobView, status: int) -> JSONResponse:
    return JSONResponse(view.model_dump(mode="json", exclude_none=True), status_code=status,
                        headers={"Location": f"/v1/jobs/{view.id}"})


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
