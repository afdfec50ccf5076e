"""Structured logs: one JSON object per line, with the request and job ids as fields. Events carry
figures and ids only; request bodies and keys are never logged."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

# Fields a log call may attach with `extra=`; everything else on a record is logging's own.
EVENT_FIELDS = ("event", "request_id", "job_id", "worker_id", "method", "path", "status", "duration_ms",
                "queue_ms", "prefill_ms", "branches_ms", "questions", "prefix_tokens", "cached_tokens",
                "error_type")


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", ...event fields}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in EVENT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for every openjev process; chatty libraries only above INFO."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every health check and engine call; arq logs every job with a preview of its args.
    for noisy in ("httpx", "httpcore", "arq.worker", "arq.jobs", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RepeatedFailure:
    """The warnings of one thing that fails again on every try while what it needs is down (a worker's
    heartbeat, its look at the queue, its claims, while Redis restarts or fails over): the first failure,
    then at most one every `interval` seconds with how many failed since, and one line once it works
    again, saying for how long it had failed. A log that stays readable through an outage of minutes.

    A thing that flaps (a Redis near its maxmemory that refuses some writes and takes others) keeps to the
    same pace: a failure within `interval` of the last warning is counted, not warned, even after a
    success between, and such an unannounced run of failures ends without a line; the next warning counts
    them, with how many times it worked again between."""

    def __init__(self, logger: logging.Logger, what: str, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.clock = clock
        self.failures = 0  # since the last success
        self._first_at = 0.0
        self._announced = False  # this run of failures has had a warning
        self._total = 0  # every failure
        self._warned_at = -math.inf
        self._warned_total = 0  # failures reported, by a warning or by an announced run's end
        self._quiet_recoveries = 0  # unannounced runs of failures ended since the last warning

    def failed(self, error: object, next_try: str = "") -> None:
        """Count one failure; warn unless a warning was given in the last `interval` s. `error`: the exception,
        or what the failure was (shown by its repr); `next_try`: when it is tried again, or what else to
        know, as a clause ("the next look, in 0.5 s, tries again")."""
        now = self.clock()
        self.failures += 1
        self._total += 1
        if self.failures == 1:
            self._first_at = now
        if now - self._warned_at < self.interval:
            return
        since = []
        if self._total - self._warned_total > 1:
            since.append(f"{self._total - self._warned_total} more failures in {now - self._warned_at:.0f} s")
        if self.failures > 1:
            since.append(f"{self.failures} in {now - self._first_at:.0f} s")
        if self._quiet_recoveries:
            since.append(f"working again {self._quiet_recoveries} times between")
        detail = "; " + ", ".join(since) if since else ""
        self.logger.warning("%s failed (%r%s)%s", self.what, error, detail, f"; {next_try}" if next_try else "")
        self._warned_at, self._warned_total, self._quiet_recoveries = now, self._total, 0
        self._announced = True

    def succeeded(self) -> None:
        """It worked: after an announced run of failures, one line saying so; then the count starts again."""
        if not self.failures:
            return
        if self._announced:
            self.logger.info("%s works again after %d failures in %.1f s", self.what, self.failures,
                             self.clock() - self._first_at)
            self._warned_total = self._total  # all reported
        else:
            self._quiet_recoveries += 1
        self.failures = 0
        self._announced = False
