"""Whether the worker's engine can serve, judged by probing its `/health` on a schedule of its own.
SGLang's `/health` runs a one-token generation and may take up to `SGLANG_HEALTH_CHECK_TIMEOUT`
(20 s) under load: a slow answer means busy, never dead. Only an engine that refuses connections,
answers that it is unhealthy, or stays silent past a generous timeout again and again is taken out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import StrEnum

import httpx

log = logging.getLogger("openjev.worker")


class Probe(StrEnum):
    """How one health probe ended."""

    healthy = "healthy"  # 200
    refused = "refused"  # no connection: nothing listens there (a dead engine)
    unhealthy = "unhealthy"  # it answered, but not 200 (starting, or its own health generation failed)
    silent = "silent"  # no answer within the probe timeout (busy, or hung when it repeats)


@dataclass(frozen=True)
class HealthPolicy:
    """When probes happen and what their results mean."""

    interval: float = 2.0  # seconds from the end of one probe to the start of the next
    timeout: float = 30.0  # seconds a probe waits: above SGLang's own 20 s health check limit
    silent_probes_before_out: int = 2  # consecutive silent probes before the engine counts as hung
    failures_before_down: int = 3  # consecutive failed probes (any kind) before the engine is given up


class EngineHealth:
    """The engine's health as last probed. `routable` says whether jobs should be routed to this
    worker; `down` is set once the engine has failed enough probes in a row to give up on it."""

    def __init__(self, base_url: str, policy: HealthPolicy | None = None) -> None:
        self.policy = policy or HealthPolicy()
        # Its own connection: a probe never waits for a pooled connection behind the job's calls.
        self._http = httpx.AsyncClient(base_url=base_url, timeout=self.policy.timeout)
        self.routable = True
        self.down = asyncio.Event()
        self._failures = 0
        self._silent = 0

    async def probe(self) -> Probe:
        """Probe `/health` once and record the result."""
        try:
            response = await self._http.get("/health")
        except httpx.TimeoutException:
            result = Probe.silent
        except httpx.HTTPError:
            result = Probe.refused
        else:
            result = Probe.healthy if response.status_code == 200 else Probe.unhealthy
        self.record(result)
        return result

    def record(self, result: Probe) -> None:
        """Fold one probe's result into `routable` and `down`."""
        if result is Probe.healthy:
            self._failures = self._silent = 0
            self.routable = True
            return
        self._failures += 1
        self._silent = self._silent + 1 if result is Probe.silent else 0
        # One silent probe is a busy engine: it keeps its jobs; a refusal or a bad answer is not.
        self.routable = result is Probe.silent and self._silent < self.policy.silent_probes_before_out
        if self._failures >= self.policy.failures_before_down:
            self.down.set()

    async def watch(self) -> None:
        """Probe on schedule until the engine is down."""
        while not self.down.is_set():
            await asyncio.sleep(self.policy.interval)
            result = await self.probe()
            if result is not Probe.healthy:
                log.warning("engine health probe: %s (%d in a row)", result.value, self._failures)

    async def close(self) -> None:
        await self._http.aclose()
