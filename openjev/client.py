"""What openjev's own clients (`openjev batch`, `openjev smoke`, the quality bench) agree on about the
API: which answers mean "try again", which job statuses are final, and how long a Retry-After asks
them to wait."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import httpx

RETRY_STATUSES = frozenset({429, 503, 529})  # the tenant's rate, starting up, or shedding load: "try again"
TERMINAL_JOB_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired"})


def retry_after(response: httpx.Response, default: float, floor: float = 0.0, ceiling: float = 60.0) -> float:
    """Seconds to wait before asking again: the response's Retry-After (seconds or an HTTP date) held
    between `floor` and `ceiling` (so one answer cannot stall a run), or `default` without a usable one."""
    value = response.headers.get("retry-after", "").strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return min(max(seconds, floor), ceiling)
