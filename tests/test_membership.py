"""Worker membership (common/queue/membership.py): who is in the routing set, and the counters a worker
publishes with its heartbeat."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from common.queue import keys
from common.queue.membership import (
    LIVENESS_WINDOW,
    WorkerCounters,
    WorkerInfo,
    heartbeat,
    leave,
    live_workers,
    silent_members,
)
from tests.conftest import redis_now


@dataclass(frozen=True)
class Call:
    prompt_tokens: int
    cached_tokens: int | None


def info(worker_id: str, **fields: object) -> WorkerInfo:
    return WorkerInfo(id=worker_id, queue=f"q:{worker_id}", model="m", max_jobs=4, max_branches=16,
                      started_at=time.time(), **fields)


async def test_a_worker_that_stops_heartbeating_leaves_the_routing_set_after_the_liveness_window(redis: Redis) -> None:
    await heartbeat(redis, info("w1"))
    beat = await redis.zscore(keys.WORKERS, "w1")
    assert beat is not None and 0 <= await redis_now(redis) - beat < 1.0  # stamped with Redis's clock
    await redis.zadd(keys.WORKERS, {"w1": await redis_now(redis) - LIVENESS_WINDOW + 0.5})
    assert [w.id for w in await live_workers(redis)] == ["w1"] and await silent_members(redis) == []
    await redis.zadd(keys.WORKERS, {"w1": await redis_now(redis) - LIVENESS_WINDOW - 0.5})
    assert await live_workers(redis) == [] and await silent_members(redis) == ["w1"]


async def test_a_worker_whose_engine_is_down_or_that_left_is_not_routed_to(redis: Redis) -> None:
    await heartbeat(redis, info("sick", engine_ok=False))
    await heartbeat(redis, info("leaving"))
    await heartbeat(redis, info("well"))
    await leave(redis, "leaving")
    assert [w.id for w in await live_workers(redis)] == ["well"]


async def test_counters_travel_with_the_heartbeat_and_give_the_hit_ratios(redis: Redis) -> None:
    worker = info("w1")
    worker.counters.record_job(Call(100, 20), [Call(130, 100), Call(140, 100)])
    worker.counters.record_job(Call(100, 99), [Call(130, 129), Call(140, 139)])
    await heartbeat(redis, worker)
    [seen] = await live_workers(redis)
    assert seen.counters == worker.counters
    assert (seen.counters.jobs_done, seen.counters.branch_calls, seen.counters.branch_prompt_tokens) == (2, 4, 540)
    assert seen.counters.branch_hit_ratio == pytest.approx(468 / 540)
    assert seen.counters.warm_hit_ratio == pytest.approx(119 / 200)


def test_hit_ratios_are_unknown_before_any_job_and_when_the_engine_does_not_report_hits() -> None:
    counters = WorkerCounters()
    assert counters.branch_hit_ratio is None and counters.warm_hit_ratio is None
    counters.record_job(Call(100, None), [Call(130, None)])  # SGLang 0.5.19's Rust frontend omitted cached_tokens
    assert counters.unreported_calls == 2
    assert counters.branch_hit_ratio is None and counters.warm_hit_ratio is None
