"""Whether the worker's engine can serve, judged by probing its `/health` on a schedule of its own.
SGLang's `/health` runs a one-token generation: under load it may stay silent for up to
`SGLANG_HEALTH_CHECK_TIMEOUT` (20 s), and then answer 503 when the scheduler produced nothing in
that time, which on a CPU one long forward pass does (a 255-option prefill took minutes there).
So a slow or failed probe means busy, never dead, while the engine works on calls (answers them,
or has them in flight, for at most their jobs' deadlines): only an engine that refuses
connections, or one that stays unresponsive with no call in flight or answered for several probe
timeouts, is taken out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from common.logs import RepeatedFailure
from worker.engine_http import TRANSPORT_ERRORS, CallTimeout, EngineHttp

log = logging.getLogger("openjev.worker")

PROBE_KEEPALIVE = 4.0  # seconds an idle probe connection is kept
PROBE_ANSWER_BYTES = 64 * 1024  # the most of a /health answer read: its status is what counts


class Probe(StrEnum):
    """How one health probe ended."""

    healthy = "healthy"  # 200
    refused = "refused"  # no connection: nothing listens there (a dead engine)
    unhealthy = "unhealthy"  # it answered, but not 200 (SGLang: its health generation saw no progress)
    silent = "silent"  # no answer within the probe timeout


@dataclass(frozen=True)
class HealthPolicy:
    """When probes happen and what their results mean."""

    interval: float = 2.0  # seconds from the end of one probe to the start of the next
    timeout: float = 30.0  # seconds a probe waits: above SGLang's own 20 s health check limit
    out_after_timeouts: float = 2.0  # unresponsive this many probe timeouts with no call worked on: out
    down_after_timeouts: float = 6.0  # ... this many: the engine is hung, given up
    refusals_before_down: int = 3  # consecutive refused connections before a dead engine is given up


class EngineHealth:
    """The engine's health as last probed. `routable` says whether jobs should be routed to this
    worker; `down` is set once the engine is dead or hung. `last_seen_working` gives the monotonic
    time the engine was last seen working on calls (which a failed probe cannot outweigh)."""

    def __init__(self, base_url: str, policy: HealthPolicy | None = None,
                 last_seen_working: Callable[[], float] = lambda: 0.0) -> None:
        self.policy = policy or HealthPolicy()
        # Its own connection: a probe never waits for a pooled connection behind the job's calls.
        # Kept alive from one probe to the next (2 s apart) and closed before the engine's uvicorn
        # closes it (5 s idle): a new connection per probe would cost more than the probe.
        self._http = EngineHttp(base_url, max_connections=1, keepalive_expiry=PROBE_KEEPALIVE)
        self._last_seen_working = last_seen_working
        self.routable = True
        self.down = asyncio.Event()
        self._unresponsive_since: float | None = None  # start of the probes failing with the engine idle
        self._refusals = 0  # consecutive
        self._refused = False  # a refusal since the last healthy probe: out until healthy again
        self._suspected = False  # a call failed for the engine's sake: out until a probe gets an answer
        self._recheck = asyncio.Event()  # set by `suspect`: probe now rather than at the next interval
        # Clear from a refusal or a failed call until a probe gets an HTTP answer (200, or SGLang's 503 when
        # busy: it is there and answering): the worker starts no job meanwhile.
        self.answering = asyncio.Event()
        self.answering.set()
        # A busy SGLang fails its probes for minutes while it answers the jobs' calls: a warning every 10 s
        # with the count, not one a probe; a change of routing is logged at once.
        self._probe_failures = RepeatedFailure(log, "engine health probe")

    async def probe(self) -> Probe:
        """Probe `/health` once and record the result."""
        started = time.monotonic()
        try:
            status, _ = await self._http.request("GET", "/health", self.policy.timeout, limit=PROBE_ANSWER_BYTES)
        except CallTimeout:
            result = Probe.silent
        except TRANSPORT_ERRORS:
            result = Probe.refused
        else:
            result = Probe.healthy if status == 200 else Probe.unhealthy
        self.record(result, started, time.monotonic())
        return result

    def record(self, result: Probe, started: float, now: float) -> None:
        """Fold one probe (begun at `started`, ended at `now`, monotonic) into `routable` and `down`."""
        if result is Probe.healthy:
            self._unresponsive_since, self._refusals, self._refused, self._suspected = None, 0, False, False
            self.routable = True
            self.answering.set()
            return
        if result is Probe.unhealthy:
            self._suspected = False
            self.answering.set()
        elif result is Probe.refused:
            self.answering.clear()
        if self._unresponsive_since is None or self._last_seen_working() > self._unresponsive_since:
            self._unresponsive_since = started  # it worked on calls meanwhile: busy so far, count from here
        self._refusals = self._refusals + 1 if result is Probe.refused else 0
        self._refused = self._refused or result is Probe.refused
        unresponsive = now - self._unresponsive_since
        self.routable = (not self._refused and not self._suspected
                         and unresponsive < self.policy.out_after_timeouts * self.policy.timeout)
        if (self._refusals >= self.policy.refusals_before_down
                or unresponsive >= self.policy.down_after_timeouts * self.policy.timeout):
            self.down.set()

    def suspect(self) -> None:
        """A call just failed for the engine's sake (unreachable, reset, 5xx, hung): out of routing, and no
        job started, until a probe gets an answer, so no job goes to an engine that may be gone."""
        self._suspected = True
        self.routable = False
        self.answering.clear()
        self._recheck.set()

    async def watch(self) -> None:
        """Probe on schedule, or at once after a `suspect`, until the engine is down."""
        while not self.down.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), self.policy.interval)
            self._recheck.clear()
            routed = self.routable
            result = await self.probe()
            if result is Probe.healthy:
                self._probe_failures.succeeded()
            else:
                self._probe_failures.failed(result.value, f"routed: {self.routable}")
            if self.routable != routed:
                log.log(logging.INFO if self.routable else logging.WARNING, "engine %s routing after a probe %s",
                        "back in" if self.routable else "taken out of", result.value)

    async def close(self) -> None:
        await self._http.aclose()
