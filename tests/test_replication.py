"""A lone Redis (serve, compose: no replica) is asked about its replicas once a second, not once per
promise: a worker's stored outcome costs no INFO round trip of its own (issue 29). The waits on a real
replica, stalled or gone, are tests/test_sentinel_failover.py's."""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

from common.queue import replication
from common.queue.replication import ALONE_RECHECK, ReplicaCopy


async def info_calls(redis: Redis) -> int:
    """INFO commands Redis has run before this one."""
    stats = await redis.info("commandstats")
    return next((v["calls"] for k, v in stats.items() if k in ("info", "cmdstat_info")), 0)


async def test_a_lone_master_is_asked_once_per_recheck_not_once_per_promise(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [time.monotonic()]
    monkeypatch.setattr(replication.time, "monotonic", lambda: now[0])
    copies = ReplicaCopy(redis)
    before = await info_calls(redis)
    assert [await copies.wait() for _ in range(50)] == [False] * 50
    assert await info_calls(redis) - before == 2  # one INFO for the 50 promises, and the counting one
    now[0] += ALONE_RECHECK  # a second later the next promise asks again
    before = await info_calls(redis)
    assert await copies.wait() is False
    assert await copies.wait() is False
    assert await info_calls(redis) - before == 2
