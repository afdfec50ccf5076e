"""The evaluation job: the versioned JSON record the API hands the worker, and the status record
that tracks it until a result (or an error) is stored for the caller."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from enum import StrEnum
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from common.settings import ConfidenceMode

JOB_RECORD_VERSION = 1
GROUPED_JOB_RECORD_VERSION = 2
"""A job with a grouped choice question (`final_rounds`): a worker that predates them refuses it rather than
answering from the first round alone."""


class JobStatus(StrEnum):
    queued = "queued"  # accepted and waiting in a worker's queue
    running = "running"  # a worker is evaluating it
    succeeded = "succeeded"  # `result` holds the /v1/systemone response body
    failed = "failed"  # `error` holds the contract's error detail
    cancelled = "cancelled"  # the caller went away or asked to cancel
    expired = "expired"  # its deadline passed before it could finish

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.queued, JobStatus.running)


class Lane(StrEnum):
    """Which work a worker starts first. Within a lane, tenants share by weight (common/queue/placement.py)."""

    interactive = "interactive"  # someone is waiting: every sync request, and async jobs that ask for it
    batch = "batch"  # nobody is waiting on this one job: the default for async jobs


class Branch(BaseModel):
    """One question: the tokens after the shared prefix, and how to read its label logprobs."""

    question_id: str
    kind: Literal["noul", "choice", "score"]
    suffix_ids: list[int]
    label_ids: list[int]
    option_names: list[str]  # answer keys, in request order
    legend: list[Any] | None = None  # score levels, echoed unchanged
    option_order: list[int] | None = None  # a debiasing rotation: the option at each label (None: label i = option i)
    calibrated_temperature: float = 1.0  # the fitted temperature (OPENJEV_CALIBRATION) for this question
    calibrated_log_odds_offset: float = 0.0  # noul: the fitted label prior on "true" (0: none)
    group: int | None = None  # a grouped choice question's first round: which group this branch shows


class FinalRound(BaseModel):
    """A grouped choice question's second round, in token pieces: the worker lists each group's winner
    under its own label and scores the labels, with no tokenizer of its own. The pieces join into exactly
    the ids of the question's text (checked when they are cut, common/prompt.py)."""

    groups: int  # how many options it lists: one per group
    head_ids: list[int]  # the question and the options heading
    list_label_ids: list[list[int]]  # per position: its label's tokens at the start of an option line
    line_ids: list[list[int]]  # per option (request order): the rest of its line after the label
    tail_ids: list[int]  # the reply instruction, the rest of the template and the answer marker
    label_ids: list[int]  # per position: the label token scored after the answer marker

    def suffix_ids(self, options: list[int]) -> list[int]:
        """The second round's suffix listing `options` (indices, one per group, in the order shown)."""
        if len(options) != self.groups:
            raise ValueError(f"a final round lists one option per group ({self.groups}), not {len(options)}")
        ids = list(self.head_ids)
        for position, option in enumerate(options):
            ids += self.list_label_ids[position] + self.line_ids[option]
        return ids + self.tail_ids

    @property
    def most_tokens(self) -> int:
        """Its longest suffix, whichever options win: the bound admission control charges before any GPU work."""
        longest = sorted((len(line) for line in self.line_ids), reverse=True)[:self.groups]
        labels = sum(len(label) for label in self.list_label_ids)
        return len(self.head_ids) + labels + sum(longest) + len(self.tail_ids)


class JobSpec(BaseModel):
    """Everything a worker needs to evaluate one request; never contains client JSON to parse."""

    version: Literal[1, 2] = JOB_RECORD_VERSION
    id: str
    request_id: str
    model: str  # the name reported back in the response
    prefix_ids: list[int]
    prefix_hash: str
    branches: list[Branch]
    final_rounds: dict[str, FinalRound] = Field(default_factory=dict)  # by question id: grouped choice questions
    created_at: float
    deadline_at: float  # epoch seconds; past it the job is not run and its calls are aborted
    temperature: float
    confidence: ConfidenceMode

    def remaining(self, now: float | None = None) -> float:
        """Seconds left before the deadline (negative once past)."""
        return self.deadline_at - (time.time() if now is None else now)

    @property
    def total_input_tokens(self) -> int:
        """Tokens sent to the engine: the warm prefix once plus prefix + suffix per branch (a grouped question's
        second round at its longest)."""
        prefix = len(self.prefix_ids)
        finals = sum(prefix + final.most_tokens for final in self.final_rounds.values())
        return prefix + sum(prefix + len(b.suffix_ids) for b in self.branches) + finals


class Timings(BaseModel):
    """Seconds spent in each stage, reported in `Server-Timing`."""

    queue: float = 0.0
    prefill: float = 0.0
    branches: float = 0.0


class JobOutcome(BaseModel):
    """What a worker stores when a job ends: the response body, or an error, and the figures."""

    status: JobStatus
    result: dict[str, Any] | None = None  # exactly the /v1/systemone response body
    error: dict[str, str] | None = None  # {"error_type", "message"}
    http_status: int | None = None  # the status the sync facade answers with on error
    prefix_tokens: int = 0
    cached_tokens: int | None = None  # None when the engine does not report cache hits
    timings: Timings = Field(default_factory=Timings)
    worker_id: str | None = None
    finished_at: float = Field(default_factory=time.time)
    attempts: int = 1  # times a worker started the job, this one included (an engine failure or a crash re-runs it)


def serialize(obj: Any) -> bytes:
    """arq's job serializer on both sides of the queue: JSON, never pickle."""
    return orjson.dumps(obj)


class JobArgument(dict):  # type: ignore[type-arg]
    """A job as arq hands it to `evaluate`: the job's JSON object, whose repr names the job only. arq
    formats every job's arguments for its start log line (`args_to_string`) whether or not that line is
    logged; printed whole, a job is its prompt's token ids (the client's state, readable again through
    the tokenizer), and formatting them was 2% of the worker's CPU per README request."""

    def __repr__(self) -> str:
        return f"<job {self.get('id')}>"


def deserialize(raw: bytes) -> Any:
    """arq's job deserializer: the payload, with each job argument a `JobArgument`."""
    payload = orjson.loads(raw)
    if isinstance(payload, dict) and isinstance(args := payload.get("a"), list):
        payload["a"] = [JobArgument(arg) if isinstance(arg, dict) else arg for arg in args]
    return payload


JOB_ID = re.compile(r"job_(([0-9a-f]{12})[0-9a-f]{32})([0-9a-f]{16})")  # ms (hex), 128 random bits, the tag


class JobIds:
    """Issues job ids and recognises the ones it issued. An id is unguessable (128 random bits), carries
    its creation time, so a job whose record is missing can be told apart (lost, or expired), and ends
    with a tag (64 bits of HMAC-SHA256 under the server's key), so an id the server never issued is
    unknown rather than lost. Every API replica must hold the same key (`Settings.job_id_key`)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def new(self, created_at: float) -> str:
        """A fresh id for a job created at `created_at` (epoch seconds)."""
        body = f"{int(created_at * 1000):012x}{secrets.token_hex(16)}"
        return f"job_{body}{self._tag(body)}"

    def created_at(self, job_id: str) -> float | None:
        """The creation time (epoch seconds) in an id this key issued; None for any other string."""
        match = JOB_ID.fullmatch(job_id)
        if match is None or not hmac.compare_digest(match.group(3), self._tag(match.group(1))):
            return None
        return int(match.group(2), 16) / 1000

    def _tag(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:16]


def new_request_id() -> str:
    """The `x-typesafe-request-id` value: `req_<hex>`."""
    return "req_" + secrets.token_hex(12)
