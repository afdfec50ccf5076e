"""Placement inside Redis (common/queue/placement.py) makes exactly the routing choices of the Python
reference (tests/routing_reference.py), writes the job where it routed it, and
claims the idempotency key in the same step."""

from __future__ import annotations

import logging
import random
import time

import pytest
from redis.asyncio import Redis

from common.queue import keys
from common.queue.membership import LIVENESS_WINDOW, WorkerInfo, heartbeat
from common.queue.placement import FAIR_ORIGIN_MS, Admission, Dispatcher, IdempotencyClaim, Placement
from common.routing import prefix_key
from common.settings import RoutingPolicy
from tests.conftest import redis_now
from tests.routing_reference import admit, expected_finish, round_robin, route_job


async def build_fleet(redis: Redis, rng: random.Random) -> tuple[dict[str, WorkerInfo], dict[str, int]]:
    """A random fleet in Redis: live, engine-down and stale workers, random queues and job times.
    Returns the workers the API may route to and their queue lengths."""
    await redis.flushdb()
    live: dict[str, WorkerInfo] = {}
    lengths: dict[str, int] = {}
    for i in range(rng.randint(1, 6)):
        info = WorkerInfo(id=f"gpu-{i}-{rng.randint(0, 999)}", queue=keys.queue_name(f"gpu-{i}"), model="m",
                          max_jobs=rng.randint(1, 4), max_branches=64, started_at=time.time(),
                          engine_ok=rng.random() > 0.15, avg_job_seconds=rng.choice([0.0, 0.4, 1.5, 6.0]))
        info.running = rng.randint(0, info.max_jobs)
        queued = rng.randint(0, 9)
        await heartbeat(redis, info)
        if rng.random() < 0.1:  # silent past the liveness window: out of the routing set
            await redis.zadd(keys.WORKERS, {info.id: time.time() - LIVENESS_WINDOW - 1})
        elif info.engine_ok:
            live[info.id] = info
            lengths[info.id] = queued
        if queued:  # queued before a new job in fair order: at lower scores than its own (its clocks are unset)
            await redis.zadd(info.queue, {f"old-{i}-{n}": -FAIR_ORIGIN_MS - 1 - n for n in range(queued)})
    return live, lengths


def reference(key: str, live: dict[str, WorkerInfo], lengths: dict[str, int], load_factor: float,
              remaining: float, turn: int | None = None) -> Placement:
    """What the Python reference decides for the same state."""
    if not live:
        return Placement(no_worker=True)
    if turn is None:
        waiting = {w: max(0, lengths[w] - live[w].max_jobs) for w in live}
        chosen = route_job(key, waiting, load_factor)
    else:
        chosen = round_robin(turn, list(live))
    finish_in = {w: expected_finish(live[w], lengths[w]) for w in live}
    target = admit(key, chosen, finish_in, remaining)
    if target is None:
        return Placement(soonest=min(finish_in.values()))
    return Placement(queue=live[target].queue)


async def place(dispatcher: Dispatcher, job_id: str, key: str, remaining: float,
                idempotency: IdempotencyClaim | None = None) -> Placement:
    return await dispatcher.place(job_id, key, remaining, {"status": "queued", "request_id": "req_t"}, 600, b"{}",
                                  idempotency)


async def test_hash_routing_in_redis_matches_the_reference_on_random_fleets(redis: Redis) -> None:
    rng = random.Random(11)
    outcomes = {"ok": 0, "none": 0, "overloaded": 0}
    for trial in range(300):
        live, lengths = await build_fleet(redis, rng)
        load_factor = rng.choice([1.0, 1.25, 2.0])
        key = prefix_key([trial, rng.randint(0, 10**6)])
        remaining = rng.choice([0.5, 3.0, 20.0, 120.0])
        got = await place(Dispatcher(redis, load_factor, RoutingPolicy.hash), f"job_{trial}", key, remaining)
        want = reference(key, live, lengths, load_factor, remaining)
        assert (got.queue, got.no_worker) == (want.queue, want.no_worker), trial
        if want.soonest is not None:
            assert got.soonest is not None and abs(got.soonest - want.soonest) < 1e-9
        outcomes["ok" if got.queue else "none" if got.no_worker else "overloaded"] += 1
    assert min(outcomes.values()) >= 10, outcomes  # every branch of the decision was exercised


async def test_round_robin_in_redis_takes_turns_like_the_reference(redis: Redis) -> None:
    rng = random.Random(5)
    live, lengths = await build_fleet(redis, rng)
    while len(live) < 3:
        live, lengths = await build_fleet(redis, rng)
    for info in live.values():  # nobody is overloaded here: the turn alone decides
        info.avg_job_seconds = 0.0
        await heartbeat(redis, info)
    dispatcher = Dispatcher(redis, 1.25, RoutingPolicy.round_robin)
    for turn in range(1, 10):
        got = await place(dispatcher, f"job_rr_{turn}", prefix_key([turn]), 60.0)
        assert got.queue == reference(prefix_key([turn]), live, lengths, 1.25, 60.0, turn=turn).queue
        lengths[next(w for w in live if live[w].queue == got.queue)] += 1


async def test_a_placed_job_is_recorded_and_enqueued_in_arqs_layout_on_redis_time(redis: Redis) -> None:
    info = WorkerInfo(id="solo", queue=keys.queue_name("solo"), model="m", max_jobs=2, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    before = await redis_now(redis)
    placed = await Dispatcher(redis, 1.25, RoutingPolicy.hash).place(
        "job_x", "k", 30.0, {"status": "queued", "request_id": "req_x"}, 90, b'{"f":"evaluate"}')
    assert placed.queue == info.queue
    assert 0 <= placed.created_at - before < 1.0  # Redis's clock, not this host's
    assert abs(placed.deadline_at - placed.created_at - 30.0) < 1e-3
    record = await redis.hgetall(keys.job_key("job_x"))
    assert {k: record[k] for k in (b"status", b"request_id", b"queue", b"placement")} == {
        b"status": b"queued", b"request_id": b"req_x", b"queue": info.queue.encode(), b"placement": b"job_x.1"}
    assert 115 <= await redis.ttl(keys.job_key("job_x")) <= 120  # the deadline, then 90 s
    assert await redis.get(keys.ARQ_JOB + "job_x.1") == b'{"f":"evaluate"}'
    assert 115 <= await redis.ttl(keys.ARQ_JOB + "job_x.1") <= 120
    (entry, score), = await redis.zrange(info.queue, 0, -1, withscores=True)
    assert entry == b"job_x.1"
    # arq's score: the job's fair start (0: the first on an idle queue) less the fair origin, due on any clock
    assert score == -FAIR_ORIGIN_MS and score < time.time() * 1000 - 3600_000
    assert await redis.hget(keys.job_key("job_x"), "fair_start") == b"0"


async def test_an_idempotency_key_is_claimed_with_the_placement_and_only_then(redis: Redis) -> None:
    dispatcher = Dispatcher(redis, 1.25, RoutingPolicy.hash)
    claim = IdempotencyClaim("retry-me", "d1")
    assert (await place(dispatcher, "job_early", "k", 30.0, claim)).no_worker
    assert not await redis.exists(keys.idempotency_key("default", "retry-me"))  # nothing placed, nothing held
    info = WorkerInfo(id="solo", queue=keys.queue_name("solo"), model="m", max_jobs=2, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    assert (await place(dispatcher, "job_first", "k", 30.0, claim)).queue == info.queue
    again = await place(dispatcher, "job_second", "k", 30.0, IdempotencyClaim("retry-me", "d2"))
    assert again == Placement(held="job_first:d1")
    assert not await redis.exists(keys.job_key("job_second"))
    assert await redis.zrange(info.queue, 0, -1) == [b"job_first.1"]


async def test_a_redis_within_the_headroom_of_its_maxmemory_places_nothing_and_writes_nothing(redis: Redis) -> None:
    info = WorkerInfo(id="solo", queue=keys.queue_name("solo"), model="m", max_jobs=2, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    memory = await redis.info("memory")
    limit = memory["used_memory"] * 2  # used: half of maxmemory, the rest free
    claim = IdempotencyClaim("retry-me", "d1")
    await redis.config_set("maxmemory", limit)
    try:
        written = set(await redis.keys("*"))
        full = await place(Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=0.6), "job_full", "k", 30.0, claim)
        assert full == Placement(full=True)  # 0.6 kept: only 0.4 of maxmemory is the placements'
        assert set(await redis.keys("*")) == written  # no record, no arq job, no key held, no clock moved
        sync = await Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=0.6).place(
            "job_sync", "k", 30.0, {"status": "queued", "request_id": "req_s"}, 600, b"{}",
            admission=Admission(sync=True))
        assert sync.queue == info.queue  # a sync job may use half the headroom: 0.3 kept, 0.5 used
        placed = await place(Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=0.4), "job_room", "k", 30.0, claim)
        assert placed.queue == info.queue
        await redis.config_set("maxmemory", 0)  # no limit: the headroom is of nothing
        unlimited = Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=0.99)
        assert (await place(unlimited, "job_unlimited", "k", 30.0)).queue == info.queue
    finally:
        await redis.config_set("maxmemory", 0)


async def test_a_redis_that_refuses_info_places_jobs_without_the_headroom_and_the_log_says_so(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    info = WorkerInfo(id="solo", queue=keys.queue_name("solo"), model="m", max_jobs=2, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    await redis.acl_setuser("no-info", enabled=True, passwords=["+secret-of-the-test"], keys=["*"], channels=["*"],
                            commands=["+@all", "-info"])  # a managed Redis's ACL may forbid INFO
    where = redis.connection_pool.connection_kwargs
    limited = Redis(host=where["host"], port=where["port"], username="no-info", password="secret-of-the-test")
    try:
        dispatcher = Dispatcher(limited, 1.25, RoutingPolicy.hash, headroom=0.1)
        with caplog.at_level(logging.WARNING, logger="openjev.queue"):
            for n in range(3):
                assert (await place(dispatcher, f"job_{n}", "k", 30.0)).queue == info.queue
        warned = [r.getMessage() for r in caplog.records if "refuses INFO" in r.getMessage()]
        assert len(warned) == 1, warned  # once, and not asked again
        assert dispatcher.headroom == 0.0
    finally:
        await limited.aclose()
        await redis.acl_deluser("no-info")
