"""Per-tenant limits kept in Redis, so every API replica enforces the same ones: a request rate (GCRA,
one script per submission, Redis's clock) and, read here for `/v1/limits`, a tenant's jobs not yet ended
(counted by the placement script, common/queue/placement.py, which enforces those limits atomically)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from common.queue import keys

MINUTE_MS = 60_000

# KEYS[1] the tenant's rate key; ARGV: emission interval (ms), burst (requests). The generic cell rate
# algorithm: the key holds the theoretical arrival time (TAT, ms) of the next request; a request is
# allowed while TAT - now stays within the burst. Reply: {allowed 1|0, remaining, ms until allowed again
# (0 if allowed), ms until the full burst is available again}.
_ADMIT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now)
local allowed_at = tat + interval - burst * interval
if allowed_at > now then
  return {0, 0, allowed_at - now, tat - now}
end
local new_tat = tat + interval
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now))
return {1, math.floor((now - allowed_at) / interval), 0, new_tat - now}
"""

# KEYS: the tenant's jobs, async jobs and rate keys. Reply: {jobs not yet ended, async ones, rate TAT - now (ms)}.
_USAGE = """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
local jobs = redis.call('ZCOUNT', KEYS[1], now, '+inf')
local async = redis.call('ZCOUNT', KEYS[2], now, '+inf')
local tat = tonumber(redis.call('GET', KEYS[3]) or 0)
return {jobs, async, math.max(0, tat - math.floor(now * 1000))}
"""


@dataclass(frozen=True)
class RateDecision:
    """One submission against a per-minute limit, with what the RateLimit headers report."""

    allowed: bool
    limit: int  # requests per minute
    remaining: int  # requests that could be sent at once now
    retry_after: float  # seconds until one more is allowed (0 when allowed)
    reset: float  # seconds until the whole burst is available again

    def headers(self) -> dict[str, str]:
        """The common RateLimit-* fields and the IETF policy; Retry-After when refused."""
        headers = {"RateLimit-Limit": str(self.limit), "RateLimit-Remaining": str(self.remaining),
                   "RateLimit-Reset": str(math.ceil(self.reset)), "RateLimit-Policy": f"{self.limit};w=60"}
        if not self.allowed:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant has in flight now."""

    jobs: int  # jobs not yet ended, sync and async
    async_jobs: int  # async jobs not yet ended
    rate_used_ms: int  # how far its rate limiter's clock is ahead of now


class TenantLimiter:
    """Per-tenant rate and usage in Redis; one instance per API process."""

    def __init__(self, redis: Redis) -> None:
        self._admit = redis.register_script(_ADMIT)
        self._usage = redis.register_script(_USAGE)

    async def admit(self, tenant: str, per_minute: int, burst: int | None = None) -> RateDecision:
        """Count one submission of `tenant` against `per_minute`, refilled evenly, up to `burst` at once
        (None: `per_minute`)."""
        interval = MINUTE_MS / per_minute
        allowed, remaining, retry_ms, reset_ms = await self._admit(
            keys=[keys.tenant_key(tenant, "rate")], args=[repr(interval), burst or per_minute])
        return RateDecision(bool(allowed), per_minute, int(remaining), float(retry_ms) / 1000,
                            float(reset_ms) / 1000)

    async def usage(self, tenant: str) -> TenantUsage:
        jobs, async_jobs, rate_ms = await self._usage(keys=[
            keys.tenant_key(tenant, "jobs"), keys.tenant_key(tenant, "async"), keys.tenant_key(tenant, "rate")])
        return TenantUsage(int(jobs), int(async_jobs), int(rate_ms))
