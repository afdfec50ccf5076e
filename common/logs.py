"""Structured logs: one JSON object per line, with the request and job ids as fields. Events carry
figures and ids only; request bodies and keys are never logged."""

from __future__ import annotations

import json
import logging
import sys
import time
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
