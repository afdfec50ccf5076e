"""An API process's presence in Redis. A sync job has one reader: the API process that placed it, waiting
on its request. Should that process die (or lose Redis for good), the client's connection is gone with
it, and running the job would spend the engine on an answer nobody reads, for up to its deadline
(OPENJEV_REQUEST_TIMEOUT, 120 s), while the job still counts as ahead of every job behind it. So each API
process keeps a key of its own alive (`keys.api_key`, renewed five times per `ttl`), its sync jobs' records
name it, and a worker that claims a sync job which has waited long enough for a dead API's key to have
lapsed looks at that key first (records.py `record_start`): gone, the job ends as `cancelled` (503 for a
reader that is alive after all) and is taken off the queue instead of run. The worker's regular look at its
queue does the same for the jobs waiting there (records.py `record_sweep_gone`), so they leave the backlog
and stop counting as ahead of new jobs without waiting for a job slot to free. A job that waited less is not
looked at: its API's key cannot have lapsed yet, whatever happened to it, so an unloaded queue pays no
command for this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.jobs import JobOutcome, JobStatus
from common.logs import RepeatedFailure
from common.queue import keys

log = logging.getLogger("openjev.api")

RENEWALS_PER_TTL = 5  # an API renews its presence this many times within its ttl


def new_api_id() -> str:
    """This API process's id: its host and pid (for people reading logs) and a token (two processes with
    one pid, in two containers on one host, stay apart)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def unseen_before(ttl: float) -> float:
    """Seconds a sync job must have waited before its API's presence is worth looking at: until then the key
    of an API that died since placing it is still there (it was renewed at most ttl / RENEWALS_PER_TTL before
    the death, and lasts `ttl` from then)."""
    return ttl * (1 - 1 / RENEWALS_PER_TTL)


GONE_OUTCOME = JobOutcome(status=JobStatus.cancelled, http_status=503, error={
    "error_type": "unavailable_error",
    "message": "the API process waiting for this sync request stopped renewing its presence in Redis (it crashed "
               "or lost Redis), so the job was not run; retry"}).model_dump_json()


class ApiPresence:
    """Keeps `api_id`'s key alive in Redis while the process runs; Redis errors are logged (the first, then
    every 10 s) and the renewal goes on."""

    def __init__(self, redis: Redis, api_id: str, ttl: float) -> None:
        self.redis = redis
        self.api_id = api_id
        self.key = keys.api_key(api_id)
        self.ttl_ms = int(ttl * 1000)
        self.interval = ttl / RENEWALS_PER_TTL
        self._failures = RepeatedFailure(log, "renewal of this API's presence")

    async def renew(self) -> None:
        """One renewal; a Redis error is logged, not raised."""
        try:
            await self.redis.set(self.key, "1", px=self.ttl_ms)
        except (RedisError, OSError) as exc:
            self._failures.failed(exc, "workers stop starting this API's sync jobs once it lapses; retrying")
        else:
            self._failures.succeeded()

    async def keep(self) -> None:
        """Renew until cancelled."""
        while True:
            await self.renew()
            await asyncio.sleep(self.interval)

    async def leave(self) -> None:
        """Drop the key at a clean stop: a sync job of this process still queued is nobody's."""
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(self.key)
