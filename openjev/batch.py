"""`openjev batch`: classify a JSONL file of states through the async jobs API, many at a time,
with one output line per input line, in input order, and resume after a crash.

Each line's job is submitted with an Idempotency-Key made of the output file, the line number and the
request body, so a rerun after Ctrl-C or a crash finds the jobs that were in flight (the API keeps them
`OPENJEV_JOB_RESULT_TTL`, an hour by default) instead of submitting them again. With --retry-errors, a
line whose job ended in an error is submitted as a new job.

How the output survives a crash: every line is appended to `OUT.partial` (flushed) the moment it
finishes, in whatever order lines finish, each record carrying its input line number. Only when
every line is done is `OUT` written, in input order, through a temporary file renamed into place,
and `OUT.partial` removed. A rerun first reads the records in `OUT` and `OUT.partial` (a torn last
line from a crash is dropped), so it submits only the lines that have no record yet.

Records: `{"line": n, "id": <the input's "id", if any>, "result": <the /v1/systemone body>}` or
`{"line": n, "id": …, "error": {"status", "error_type", "message"}}`; `n` counts from 1 like an
editor, and `status` is the HTTP status that ended the line (null when no HTTP answer did).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from openjev.client import RETRY_STATUSES, TERMINAL_JOB_STATUSES
from openjev.client import retry_after as read_retry_after

POLL_WAIT = 30.0  # seconds each GET /v1/jobs/{id} may hold the request (the API's maximum)
MAX_RETRY_AFTER = 60.0  # a longer Retry-After is clipped so one answer cannot stall the run
PAST_DEADLINE = 120.0  # seconds past a job's deadline before we stop asking about it


@dataclass
class BatchOptions:
    """One `openjev batch` run."""

    input: Path  # JSONL: one request body, `{"state": …}` or bare JSON state per line
    output: Path  # where the ordered records go; `<output>.partial` holds them while running
    url: str  # the server root, e.g. http://127.0.0.1:8000
    questions: Path | None = None  # a `questions` object (or a whole request body) used by lines without one
    model: str = "jev-latest"  # for lines that name no model
    concurrency: int = 8  # jobs in flight at once
    api_key: str | None = None  # sent as `Authorization: Bearer`
    retry_errors: bool = False  # on resume, redo lines recorded with an error instead of keeping them
    max_attempts: int = 8  # tries per HTTP call when the server answers 429/503/529 or is unreachable
    progress: bool = True  # show a progress bar on a terminal


class LineError(Exception):
    """Why one input line has no result; becomes that line's `error` record."""

    def __init__(self, status: int | None, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    def record(self) -> dict[str, Any]:
        return {"status": self.status, "error_type": self.error_type, "message": self.message}


class BatchUsageError(Exception):
    """The run cannot start (missing input, unreadable questions file)."""


def run_batch(options: BatchOptions) -> int:
    """Run (or resume) a batch; 0 if every line has a result, 1 if some have errors, 2 on bad usage."""
    try:
        lines = read_lines(options.input)
        questions, model = load_questions(options.questions, options.model)
    except BatchUsageError as exc:
        print(f"openjev batch: {exc}", file=sys.stderr)
        return 2
    # httpx logs every request at INFO: one line per poll would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log = OutputLog(options.output)
    done = log.resume(len(lines), keep_errors=not options.retry_errors)
    todo = [(n, text) for n, text in enumerate(lines, start=1) if n not in done]
    try:
        asyncio.run(_process(options, todo, questions, model, log, already=len(lines) - len(todo)))
    except KeyboardInterrupt:
        print(f"openjev batch: interrupted; rerun the same command to resume from {log.partial}", file=sys.stderr)
        return 130
    errors = log.finish(len(lines))
    print(f"openjev batch: {len(lines)} lines, {len(lines) - errors} results, {errors} errors, "
          f"{len(lines) - len(todo)} kept from before → {options.output}", file=sys.stderr)
    return 1 if errors else 0


def read_lines(path: Path) -> list[str]:
    """The input's lines; a final newline does not start another line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BatchUsageError(f"cannot read {path}: {exc.strerror}") from exc
    # Not splitlines(): U+2028 and friends are legal inside JSON strings and must not split a record.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def load_questions(path: Path | None, model: str) -> tuple[dict[str, Any] | None, str]:
    """The shared questions (a `questions` object, or those of a whole request body) and the default model."""
    if path is None:
        return None, model
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BatchUsageError(f"cannot read questions from {path}: {exc}") from exc
    # A whole request body has a `questions` object that is not itself a question (which has a `type`).
    if isinstance(data, dict) and isinstance(data.get("questions"), dict) and "type" not in data["questions"]:
        return data["questions"], data.get("model", model)
    if not isinstance(data, dict) or not data:
        raise BatchUsageError(f"{path} must hold a JSON object of questions")
    return data, model


def request_for(text: str, questions: dict[str, Any] | None, model: str) -> tuple[Any, dict[str, Any]]:
    """The input line's `id` (or None) and the request body it stands for."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise LineError(None, "invalid_json", f"the line is not JSON: {exc}") from exc
    if isinstance(value, str | list):
        value = {"state": value}
    if not isinstance(value, dict) or "state" not in value:
        raise LineError(None, "invalid_input", "a line must be a request body, {\"state\": …}, a string or a list")
    line_id = value.pop("id", None)
    value.setdefault("model", model)
    if "questions" not in value:
        if questions is None:
            raise LineError(None, "invalid_input", "the line has no questions and no --questions file was given")
        value["questions"] = questions
    return line_id, value


class OutputLog:
    """The records written so far: appended to `<output>.partial` as lines finish, ordered into `output` at the end."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.partial = output.with_name(output.name + ".partial")
        self.records: dict[int, dict[str, Any]] = {}
        self.redone: frozenset[int] = frozenset()  # lines recorded with an error, being redone

    def resume(self, total: int, keep_errors: bool) -> set[int]:
        """Load earlier records for lines 1..total; return the line numbers that need no new work (the
        lines whose errors are dropped to be redone are in `redone`)."""
        for path in (self.output, self.partial):
            for record in _records_in(path):
                if isinstance(record.get("line"), int) and 1 <= record["line"] <= total:
                    self.records[record["line"]] = record
        if not keep_errors:
            self.redone = frozenset(n for n, r in self.records.items() if "error" in r)
            self.records = {n: r for n, r in self.records.items() if "error" not in r}
        # Rewritten whole so that later appends never land after a torn line.
        self._write(self.partial, self.records.values())
        return set(self.records)

    def append(self, record: dict[str, Any]) -> None:
        """Keep `record` and put it on disk now."""
        self.records[record["line"]] = record
        with self.partial.open("a", encoding="utf-8") as handle:
            handle.write(_dumps(record) + "\n")

    def finish(self, total: int) -> int:
        """Write `output` in input order once every line has a record; return how many are errors."""
        ordered = [self.records[n] for n in range(1, total + 1)]
        self._write(self.output, ordered)
        self.partial.unlink(missing_ok=True)
        return sum("error" in record for record in ordered)

    @staticmethod
    def _write(path: Path, records: Any) -> None:
        staging = path.with_name(path.name + ".tmp")
        with staging.open("w", encoding="utf-8") as handle:
            handle.writelines(_dumps(record) + "\n" for record in records)
        os.replace(staging, path)


def _records_in(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for text in path.read_text(encoding="utf-8").split("\n"):
        try:
            record = json.loads(text)
        except ValueError:
            continue  # a blank line, or the torn last line of a crashed run
        if isinstance(record, dict):
            yield record


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


class JobsClient:
    """Submits one request body as an async job and waits for its outcome, retrying what is worth retrying."""

    def __init__(self, client: httpx.AsyncClient, max_attempts: int, output: Path | None = None,
                 redo: frozenset[int] = frozenset()) -> None:
        """`output`: the run's output file, part of every Idempotency-Key (None: keys unique to this run);
        `redo`: lines whose earlier job ended in an error, submitted anew (--retry-errors)."""
        self.client = client
        self.max_attempts = max_attempts
        self.run_id = str(output.resolve()) if output is not None else uuid.uuid4().hex
        self.redo = redo

    def idempotency_key(self, line: int, body: dict[str, Any]) -> str:
        """The same for the same output file, line and body: a retried submit, and a rerun after Ctrl-C or a
        crash, find the job already made for the line instead of making another."""
        text = json.dumps([self.run_id, line, body], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return f"openjev-batch-{line}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    async def evaluate(self, line: int, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1/systemone response body for `body`; raises LineError when there is none."""
        key = self.idempotency_key(line, body)
        job = _json_or_error(await self._send("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}))
        if line in self.redo and job.get("status") in TERMINAL_JOB_STATUSES - {"succeeded"}:
            # The key found the job whose error is being retried: submit the line as a new job.
            key = f"{key}-{uuid.uuid4().hex[:12]}"
            job = _json_or_error(await self._send("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}))
        while job.get("status") not in TERMINAL_JOB_STATUSES:
            _give_up_past_deadline(job)
            job = _json_or_error(await self._send("GET", f"/v1/jobs/{job['id']}", params={"wait": POLL_WAIT}))
        if job["status"] == "succeeded":
            return job["result"]
        error = job.get("error") or {}
        raise LineError(None, error.get("error_type", job["status"]), error.get("message", f"the job {job['status']}"))

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for attempt in range(1, self.max_attempts + 1):
            last = attempt == self.max_attempts
            try:
                response = await self.client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if last:
                    raise LineError(None, "connection_error", f"{type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(_backoff(attempt))
                continue
            if response.status_code not in RETRY_STATUSES or last:
                return response
            await asyncio.sleep(retry_after(response, attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")


def retry_after(response: httpx.Response, attempt: int) -> float:
    """Seconds to wait before the next attempt: the server's Retry-After (seconds or a date, at most
    MAX_RETRY_AFTER), else a backoff."""
    return read_retry_after(response, default=_backoff(attempt), ceiling=MAX_RETRY_AFTER)


def _backoff(attempt: int) -> float:
    return min(0.5 * 2 ** (attempt - 1), 30.0)


def _json_or_error(response: httpx.Response) -> dict[str, Any]:
    if response.is_success:
        return response.json()
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list):  # FastAPI validation: [{"loc", "msg", "type"}, …]
        message = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
        raise LineError(response.status_code, "validation_error", message)
    if isinstance(detail, dict):
        raise LineError(response.status_code, detail.get("error_type", "api_error"), detail.get("message", ""))
    raise LineError(response.status_code, "http_error", response.text[:500])


def _give_up_past_deadline(job: dict[str, Any]) -> None:
    deadline = datetime.fromisoformat(job["deadline_at"]).timestamp()
    if time.time() > deadline + PAST_DEADLINE:
        raise LineError(None, "timeout_error", f"job {job['id']} was still {job['status']} long past its deadline")


async def _process(options: BatchOptions, todo: list[tuple[int, str]], questions: dict[str, Any] | None,
                   model: str, log: OutputLog, already: int) -> None:
    headers = {"User-Agent": "openjev-batch"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    timeout = httpx.Timeout(POLL_WAIT + 30.0, connect=10.0)
    limits = httpx.Limits(max_connections=options.concurrency)
    bar = tqdm(total=already + len(todo), initial=already, unit="line", desc="batch",
               disable=None if options.progress else True)
    async with httpx.AsyncClient(base_url=options.url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=limits) as client:
        jobs = JobsClient(client, options.max_attempts, options.output, log.redone)
        pending = iter(todo)  # shared by the workers: each next() hands out one line, in input order
        errors = 0

        async def work() -> None:
            nonlocal errors
            for line, text in pending:
                record = await _classify(jobs, line, text, questions, model)
                log.append(record)
                if "error" in record:
                    errors += 1
                    bar.set_postfix_str(f"{errors} errors", refresh=False)
                bar.update()

        await asyncio.gather(*(work() for _ in range(max(1, options.concurrency))))
    bar.close()


async def _classify(jobs: JobsClient, line: int, text: str, questions: dict[str, Any] | None,
                    model: str) -> dict[str, Any]:
    line_id = None
    try:
        line_id, body = request_for(text, questions, model)
        outcome: dict[str, Any] = {"result": await jobs.evaluate(line, body)}
    except LineError as exc:
        outcome = {"error": exc.record()}
    except (ValueError, KeyError, TypeError) as exc:  # a 2xx body that is not the jobs API's shape
        outcome = {"error": LineError(None, "unexpected_response", f"{type(exc).__name__}: {exc}").record()}
    return {"line": line, **({"id": line_id} if line_id is not None else {}), **outcome}
