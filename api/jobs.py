"""Async jobs: submit an evaluation and come back for it. `POST /v1/jobs` answers 202 with a job
id at once; `GET /v1/jobs/{id}?wait=S` long-polls for the outcome; `DELETE` cancels."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from api.auth import queue_weight, tenant_of
from api.errors import ApiError, JobLost, JobNotFound
from api.preparation import REQUEST_BODY_DOC, request_body
from api.queue_client import admission_of
from common.contract import ErrorBody, ErrorDetail, SystemOneRequest, echo
from common.jobs import JobStatus, Lane
from common.queue.placement import IdempotencyClaim
from common.queue.records import JobRecord

router = APIRouter(tags=["Async jobs"])

MAX_WAIT = 30.0  # seconds a GET may hold the request open
OVERDUE_GRACE = 5.0  # seconds past its deadline a pending job is declared expired by whoever reads it
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
    attempts: int | None = Field(default=None, description="Times a worker has started the job, shown once it "
                                 "is above 1: an engine failure or a worker crash had it run again")


class IdempotencyConflict(ApiError):
    status = 409
    error_type = "idempotency_error"


@router.post("/v1/jobs", status_code=202, response_model=JobView,
             summary="Submit an evaluation to run in the background", openapi_extra=REQUEST_BODY_DOC)
async def submit_job(request: Request, response: Response,
                     body: SystemOneRequest = Depends(request_body),
                     idempotency_key: str | None = Header(default=None, max_length=200,
                                                          description="Retries with the same key get the same job "
                                                          "(keys are per tenant)")
                     ) -> Any:
    """Validates exactly like `/v1/systemone` (same 4xx before anything is queued), then queues the job."""
    services = request.app.state.services
    services.preparer.check_request(body)
    job = await services.preparer.prepare_for(request, body, services.settings.job_timeout)
    request.state.job_id = job.id
    claim = None if idempotency_key is None else IdempotencyClaim(idempotency_key, _digest(body))
    tenant = tenant_of(request.scope)
    queued = admission_of(tenant, job, Lane(body.x_priority or Lane.batch), sync=False,
                          shared_weight=queue_weight(request.scope))
    submitted = await services.queue.submit(job, queued, idempotency=claim)
    if submitted.held is not None:
        return _located(response, _view(await _held_job(request, submitted.held, claim)), status=200)
    request.app.state.metrics.observe_acceptance(tenant.name, job.total_input_tokens)
    return _located(response, _view(await _record(request, job.id)), status=202)


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
        await queue.wait(job_id, wait)
        record = await _record(request, job_id)
    return _view(await _expire_if_overdue(request, record))


@router.delete("/v1/jobs/{job_id}", response_model=JobView, response_model_exclude_none=True, summary="Cancel a job")
async def cancel_job(request: Request, job_id: str) -> Any:
    """Ends a queued or running job as `cancelled` and aborts its engine calls; a finished job is unchanged."""
    queue = request.app.state.services.queue
    await _record(request, job_id)
    if await queue.cancel(job_id, JobStatus.cancelled, "cancelled", "the job was cancelled by its owner", 499):
        request.app.state.metrics.observe_ending(JobStatus.cancelled)
    return _view(await _record(request, job_id))


async def _record(request: Request, job_id: str) -> JobRecord:
    """The job's record, if the calling tenant owns it: another tenant's job is as unknown as a missing one."""
    services = request.app.state.services
    record = await services.queue.get(job_id)
    if record is None:
        raise _missing(job_id, services.preparer.job_ids.created_at(job_id), services.settings.job_result_ttl)
    if record.tenant != tenant_of(request.scope).name:
        raise JobNotFound(_unknown(job_id))
    return record


def _missing(job_id: str, created: float | None, result_ttl: int) -> ApiError:
    """Why `job_id` (created at `created` if this server issued it) has no record. Every record lives at least
    the result TTL from its job's creation (a finished job's for the TTL after it ended), so a missing one
    younger than that was lost."""
    if created is not None and created - CLOCK_SLACK <= time.time() < created + result_ttl - CLOCK_SLACK:
        return JobLost(f"job {echo(job_id)!r} was accepted at {_rfc3339(created)} and would still be kept, "
                       "but the queue has lost it (its Redis lost data); submit the request again")
    return JobNotFound(_unknown(job_id))


def _unknown(job_id: str) -> str:
    return f"no job {echo(job_id)!r} (unknown, or its result expired)"


async def _expire_if_overdue(request: Request, record: JobRecord) -> JobRecord:
    """A job still pending well past its deadline (its worker vanished) is reported, and recorded, as
    expired; the deadline is judged by Redis's clock, inside the ending script."""
    if record.status.terminal:
        return record
    queue = request.app.state.services.queue
    if await queue.cancel(record.id, JobStatus.expired, "timeout_error", "the job did not finish before its deadline",
                          504, after_deadline=OVERDUE_GRACE):
        request.app.state.metrics.observe_ending(JobStatus.expired)
        return await _record(request, record.id)
    return record


def _digest(body: SystemOneRequest) -> str:
    return hashlib.sha256(body.model_dump_json().encode()).hexdigest()[:32]


async def _held_job(request: Request, held: str, claim: IdempotencyClaim | None) -> JobRecord:
    """The job an Idempotency-Key already names (409 if it was submitted with a different body)."""
    held_id, _, held_digest = held.partition(":")
    if claim is None or held_digest != claim.digest:
        raise IdempotencyConflict("this Idempotency-Key was already used with a different request body")
    return await _record(request, held_id)


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
        attempts=record.attempts if record.attempts > 1 else None,
    )


def _located(response: Response, view: JobView, status: int) -> JSONResponse:
    return JSONResponse(view.model_dump(mode="json", exclude_none=True), status_code=status,
                        headers={"Location": f"/v1/jobs/{view.id}"})


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
