"""Routing inside Redis (api/dispatch.py) makes exactly the choices of the Python reference
(common/routing.py + WorkerInfo.expected_finish), and writes the job where it routed it."""

from __future__ import annotations

import random
import time

from api.dispatch import Dispatcher, Placement
from arq.constants import job_key_prefix
from redis.asyncio import Redis

from common.queue import keys
from common.queue.membership import LIVENESS_WINDOW, WorkerInfo, heartbeat
from common.routing import admit, prefix_key, round_robin, route_job
from common.settings import RoutingPolicy


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
        if queued:
            await redis.zadd(info.queue, {f"old-{i}-{n}": n for n in range(queued)})
    return live, lengths


def reference(key: str, live: dict[str, WorkerInfo], lengths: dict[str, int], load_factor: float,
              remaining: float, turn: int | None = None) -> Placement:
    """What common/routing.py decides for the same state."""
    if not live:
        return Placement(no_worker=True)
    if turn is None:
        waiting = {w: max(0, lengths[w] - live[w].max_jobs) for w in live}
        chosen = route_job(key, waiting, load_factor)
    else:
        chosen = round_robin(turn, list(live))
    finish_in = {w: live[w].expected_finish(lengths[w]) for w in live}
    target = admit(key, chosen, finish_in, remaining)
    if target is None:
        return Placement(soonest=min(finish_in.values()))
    return Placement(queue=live[target].queue)


async def place(dispatcher: Dispatcher, job_id: str, key: str, remaining: float) -> Placement:
    return await dispatcher.place(job_id, key, remaining, keys.job_key(job_id),
                                  {"status": "queued", "request_id": "req_t"}, 600, job_key_prefix + job_id, b"{}")


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


async def test_a_placed_job_is_recorded_enqueued_and_its_worker_woken_in_the_same_step(redis: Redis) -> None:
    info = WorkerInfo(id="solo", queue=keys.queue_name("solo"), model="m", max_jobs=2, max_branches=8,
                      started_at=time.time())
    await heartbeat(redis, info)
    placed = await Dispatcher(redis, 1.25, RoutingPolicy.hash).place(
        "job_x", "k", 30.0, keys.job_key("job_x"), {"status": "queued", "request_id": "req_x"}, 90,
        job_key_prefix + "job_x", b'{"f":"evaluate"}')
    assert placed == Placement(queue=info.queue)
    assert await redis.hgetall(keys.job_key("job_x")) == {b"status": b"queued", b"request_id": b"req_x",
                                                          b"queue": info.queue.encode()}
    assert 85 <= await redis.ttl(keys.job_key("job_x")) <= 90
    assert await redis.get(job_key_prefix + "job_x") == b'{"f":"evaluate"}'
    assert 85_000 <= await redis.pttl(job_key_prefix + "job_x") <= 90_000  # remaining + 60 s
    assert await redis.zrange(info.queue, 0, -1) == [b"job_x"]
    assert await redis.lrange(keys.wake_key(info.queue), 0, -1) == [b"job_x"]
