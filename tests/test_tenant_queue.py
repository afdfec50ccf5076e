"""Tenants in the queue (common/queue/placement.py, records.py, limits.py) on a real Redis: the order jobs
start in (fair shares between tenants, interactive before batch, weights), limits on a tenant's jobs not
yet ended, its rate, and idempotency keys per tenant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from common.jobs import JobOutcome, JobStatus, Lane
from common.queue import keys
from common.queue.limits import TenantLimiter
from common.queue.membership import Backlog, BacklogReader, WorkerInfo, heartbeat
from common.queue.placement import INTERACTIVE_LEAD_MS, Admission, Dispatcher, IdempotencyClaim, Placement
from common.queue.records import JobStore
from common.settings import RoutingPolicy
from tests.conftest import claim_and_start

QUEUE = keys.queue_name("solo")


async def solo_dispatcher(redis: Redis, headroom: float = 0.0, **worker: float) -> Dispatcher:
    """A dispatcher over one heartbeating worker, "solo", of two job slots (`worker`: more of its figures)."""
    await heartbeat(redis, WorkerInfo(id="solo", queue=QUEUE, model="m", max_jobs=2, max_branches=8,
                                      started_at=time.time(), **worker))
    return Dispatcher(redis, 1.25, RoutingPolicy.hash, headroom=headroom)


@pytest_asyncio.fixture(loop_scope="function")
async def dispatcher(redis: Redis) -> Dispatcher:
    return await solo_dispatcher(redis)


@asynccontextmanager
async def near_maxmemory(redis: Redis) -> AsyncIterator[None]:
    """Redis's maxmemory at twice what it uses now (used: half of it, within the band of a 0.3 headroom: past
    1 - 2 * 0.3 and short of 1 - 0.3), back to none after."""
    await redis.config_set("maxmemory", (await redis.info("memory"))["used_memory"] * 2)
    try:
        yield
    finally:
        await redis.config_set("maxmemory", 0)


async def place(dispatcher: Dispatcher, job_id: str, admission: Admission,
                idempotency: IdempotencyClaim | None = None) -> Placement:
    record = {"status": "queued", "request_id": "req_t", "kind": "sync" if admission.sync else "async"}
    return await dispatcher.place(job_id, "k", 60.0, record, 600, b"{}", idempotency, admission)


async def start_order(redis: Redis) -> list[str]:
    """The queue's jobs in the order they start: lowest score first, as the worker claims them."""
    return [keys.job_of(entry.decode()) for entry in await redis.zrange(QUEUE, 0, -1)]


async def test_a_second_tenants_first_job_starts_before_the_first_tenants_backlog(redis: Redis,
                                                                                 dispatcher: Dispatcher) -> None:
    for n in range(20):
        assert (await place(dispatcher, f"job_a{n}", Admission(tenant="a", prompts=4))).queue == QUEUE
    for n in range(3):
        assert (await place(dispatcher, f"job_b{n}", Admission(tenant="b", prompts=4))).queue == QUEUE
    order = await start_order(redis)
    # b's jobs start at b's own fair times: interleaved with a's from a's second job on, not after all 20
    assert [order.index(f"job_b{n}") for n in range(3)] == [1, 3, 5]
    assert [job for job in order if job.startswith("job_a")] == [f"job_a{n}" for n in range(20)]  # a's in order


async def test_weights_share_the_queue_in_proportion(redis: Redis, dispatcher: Dispatcher) -> None:
    for n in range(12):
        await place(dispatcher, f"job_heavy{n}", Admission(tenant="heavy", weight=2.0))
        await place(dispatcher, f"job_light{n}", Admission(tenant="light", weight=1.0))
    first = (await start_order(redis))[:12]
    assert sum(job.startswith("job_heavy") for job in first) == 8  # two of every three, by weight 2 : 1


async def test_interactive_work_starts_before_a_batch_backlog_but_only_within_its_lead(
        redis: Redis, dispatcher: Dispatcher) -> None:
    for n in range(10):
        await place(dispatcher, f"job_batch{n}", Admission(tenant="a"))
    await place(dispatcher, "job_sync", Admission(tenant="a", lane=Lane.interactive, sync=True))
    await place(dispatcher, "job_other", Admission(tenant="b", lane=Lane.interactive))
    assert set((await start_order(redis))[:2]) == {"job_sync", "job_other"}
    scores = dict(await redis.zrange(QUEUE, 0, -1, withscores=True))
    lead = scores[b"job_batch0.1"] - scores[b"job_sync.1"]
    assert lead == INTERACTIVE_LEAD_MS  # both tenants' first jobs start at the queue's virtual time: the lead apart


async def test_an_interactive_job_is_admitted_on_the_interactive_jobs_ahead_of_it_alone(redis: Redis) -> None:
    """Admission by expected finish: a job waits behind the jobs queued before it in fair order, so one tenant's
    batch job behind its whole queue, its interactive one behind its interactive jobs alone; jobs that ended
    before they started (their deadlines passed, or they were cancelled) are taken off and count no more."""
    dispatcher = await solo_dispatcher(redis, avg_job_seconds=10.0)

    async def within(job_id: str, seconds: float, lane: Lane) -> Placement:
        record = {"status": "queued", "request_id": "req_t", "kind": "async"}
        return await dispatcher.place(job_id, "k", seconds, record, 600, b"{}", admission=Admission(lane=lane))

    for n in range(20):  # (20 / 2 + 1) * 10 s = 110 s for a job behind them all
        assert (await within(f"job_batch{n}", 600, Lane.batch)).queue
    refused = await within("job_late", 60, Lane.batch)
    assert refused.queue is None and refused.soonest == pytest.approx(110)
    assert (await within("job_first", 60, Lane.interactive)).queue  # (0 / 2 + 1) * 10 s
    for n in range(10):
        assert (await within(f"job_fast{n}", 600, Lane.interactive)).queue
    behind = await within("job_behind", 60, Lane.interactive)  # (11 / 2 + 1) * 10 s = 65 s
    assert behind.queue is None and behind.soonest == pytest.approx(65)
    store = JobStore(redis, result_ttl=60)
    for n in range(10):  # ended before they started (their deadlines passed, or their callers cancelled them)
        assert await store.cancel(f"job_fast{n}", JobOutcome(status=JobStatus.expired, error={
            "error_type": "timeout_error", "message": "m"}))
    assert not await redis.exists(keys.ARQ_JOB + "job_fast0.1")  # taken off the queue with its arq keys
    assert (await within("job_behind", 60, Lane.interactive)).queue  # (1 / 2 + 1) * 10 s: counted no more


async def test_another_tenants_backlog_queued_after_a_job_in_fair_order_does_not_hold_its_admission(
        redis: Redis) -> None:
    """A job waits behind the jobs that start before it: a tenant's first job starts at the queue's virtual time,
    ahead of another tenant's backlog, so that backlog does not make it 529, however long it is."""
    dispatcher = await solo_dispatcher(redis, avg_job_seconds=10.0)

    async def within(job_id: str, seconds: float, admission: Admission) -> Placement:
        record = {"status": "queued", "request_id": "req_t", "kind": "sync" if admission.sync else "async"}
        return await dispatcher.place(job_id, "k", seconds, record, 600, b"{}", admission=admission)

    flood = Admission(tenant="alpha", lane=Lane.interactive)
    for n in range(30):  # alpha's interactive backlog: (29 / 2 + 1) * 10 s = 155 s for its last job
        assert (await within(f"job_a{n}", 600, flood)).queue
    assert (await within("job_a_late", 120, flood)).soonest == pytest.approx(160)  # its own backlog holds it
    first = await within("job_b", 120, Admission(tenant="beta", lane=Lane.interactive, sync=True))
    assert first.queue == QUEUE  # (0 / 2 + 1) * 10 s: no job queued before it
    assert (await start_order(redis)).index("job_b") <= 1  # as admitted: with alpha's first, before the rest
    batch = await within("job_b_batch", 120, Admission(tenant="beta"))  # behind every interactive job (the lead)
    assert batch.queue is None and batch.soonest == pytest.approx(165)  # (31 / 2 + 1) * 10 s


async def test_a_placement_that_will_not_run_leaves_the_waiting_set_as_it_is_claimed(
        redis: Redis, dispatcher: Dispatcher) -> None:
    await place(dispatcher, "job_gone", Admission(tenant="a", lane=Lane.interactive, sync=True))
    await place(dispatcher, "job_kept", Admission(tenant="a", lane=Lane.interactive, sync=True))
    await redis.delete(keys.job_key("job_gone"))  # its record expired
    assert await claim_and_start(redis, "job_gone.1", "solo") is None
    assert await redis.zrange(keys.waiting_key(QUEUE), 0, -1) == [b"job_kept.1"]


async def test_a_tenant_that_was_away_starts_at_the_queues_virtual_time_not_at_its_old_clock(
        redis: Redis, dispatcher: Dispatcher) -> None:
    for n in range(6):
        await place(dispatcher, f"job_a{n}", Admission(tenant="a"))
    for n in range(4):  # the worker starts a's first four: the queue's virtual time moves to a3's fair start
        assert await claim_and_start(redis, f"job_a{n}.1", "solo") is not None
    await place(dispatcher, "job_b", Admission(tenant="b"))
    waiting = [job for job in await start_order(redis) if job not in {f"job_a{n}" for n in range(4)}]
    assert waiting[0] == "job_b" or waiting[:2] == ["job_a4", "job_b"]  # next, not after a's backlog


async def test_a_tenant_at_its_concurrency_limit_is_refused_until_a_job_ends(redis: Redis,
                                                                            dispatcher: Dispatcher) -> None:
    limited = Admission(tenant="a", max_concurrent_jobs=2)
    assert (await place(dispatcher, "job_1", limited)).queue
    assert (await place(dispatcher, "job_2", limited)).queue
    assert (await place(dispatcher, "job_3", limited)).limited == ("max_concurrent_jobs", 2)
    assert (await place(dispatcher, "job_b", Admission(tenant="b", max_concurrent_jobs=2))).queue  # b unaffected
    assert not await redis.exists(keys.job_key("job_3"))  # nothing of a refused job is written
    store = JobStore(redis, result_ttl=60)
    assert await claim_and_start(redis, "job_1.1", "solo") is not None
    assert await store.store("job_1.1", JobOutcome(status=JobStatus.succeeded, result={}), time.monotonic() + 5)
    assert (await place(dispatcher, "job_3", limited)).queue  # one ended: room again
    assert await store.cancel("job_2", JobOutcome(status=JobStatus.cancelled, error={"error_type": "c",
                                                                                    "message": "m"}))
    assert (await TenantLimiter(redis).usage("a")).jobs == 1  # a cancelled job leaves the count too


async def test_queued_async_jobs_are_limited_apart_from_sync_ones(redis: Redis, dispatcher: Dispatcher) -> None:
    limited = Admission(tenant="a", max_queued_jobs=1)
    assert (await place(dispatcher, "job_async", limited)).queue
    assert (await place(dispatcher, "job_more", limited)).limited == ("max_queued_jobs", 1)
    sync = Admission(tenant="a", lane=Lane.interactive, sync=True, max_queued_jobs=1)
    assert (await place(dispatcher, "job_sync", sync)).queue  # a sync request is no queued async job
    usage = await TenantLimiter(redis).usage("a")
    assert (usage.jobs, usage.async_jobs) == (2, 1)


async def test_near_its_maxmemory_a_shared_queue_refuses_async_jobs_of_a_tenant_past_its_weights_share(
        redis: Redis) -> None:
    """Within twice the headroom of Redis's maxmemory (and short of the headroom itself), a tenant that holds
    more than its weight's share of all tenants' async jobs in Redis (its weight over all tenants' weights) places
    no more of them, even alone so far, so the rest of Redis stays the other tenants'; a heavier tenant may hold
    more; its sync jobs and a queue of one tenant are not held by it. A job that ends stays in both counts while
    its record is kept for its reader (its result is still Redis's to hold), and leaves them as that expires."""
    dispatcher = await solo_dispatcher(redis, headroom=0.3)

    def shared(tenant: str, weight: float = 1.0) -> Admission:  # alpha and beta weigh 1, gamma 2: 4 in all
        return Admission(tenant=tenant, weight=weight, shared_weight=4.0)

    for n in range(3):  # Redis far from its limit: a tenant may hold every queued job
        assert (await place(dispatcher, f"job_a{n}", shared("alpha"))).queue == QUEUE
    async with near_maxmemory(redis):
        assert (await place(dispatcher, "job_a3", shared("alpha"))).crowding == (3, 3)  # alone, holding them all
        assert not await redis.exists(keys.job_key("job_a3"))  # nothing of it written
        for n in range(2):  # beta holds 0 of 3, then 1 of 4: within its quarter
            assert (await place(dispatcher, f"job_b{n}", shared("beta"))).queue == QUEUE
        assert (await place(dispatcher, "job_b2", shared("beta"))).crowding == (2, 5)  # 2 of 5: past it
        for n in range(6):  # gamma weighs half of all: it still gets in holding 5 of 10, its share
            assert (await place(dispatcher, f"job_g{n}", shared("gamma", 2.0))).queue == QUEUE
        assert (await place(dispatcher, "job_g6", shared("gamma", 2.0))).crowding == (6, 11)
        assert (await place(dispatcher, "job_a3", shared("alpha"))).crowding == (3, 11)
        sync = Admission(tenant="alpha", lane=Lane.interactive, sync=True, shared_weight=4.0)
        assert (await place(dispatcher, "job_sync", sync)).queue == QUEUE  # no band for sync jobs
        assert await redis.zcard(keys.ASYNC_JOBS) == 11  # alpha 3, beta 2, gamma 6
        assert await redis.hget(keys.job_key("job_b0"), "counted") == b"1"  # its record says so

        store = JobStore(redis, result_ttl=2)
        assert await claim_and_start(redis, "job_a0.1", "solo") is not None
        assert await store.store("job_a0.1", JobOutcome(status=JobStatus.succeeded, result={}), time.monotonic() + 5)
        assert await store.cancel("job_a1", JobOutcome(status=JobStatus.cancelled, error={"error_type": "c",
                                                                                        "message": "m"}))
        assert await redis.zcard(keys.ASYNC_JOBS) == 11  # both ended jobs are kept for their readers
        assert await redis.zcard(keys.tenant_key("alpha", "kept")) == 2
        assert await redis.ttl(keys.tenant_key("alpha", "kept")) > 0
        # alpha has one job queued, and two results kept: 3 of 11, until those expire with their records
        assert (await place(dispatcher, "job_a3", shared("alpha"))).crowding == (3, 11)
        give_up = time.monotonic() + 10
        while (placed := await place(dispatcher, "job_a3", shared("alpha"))).queue is None:
            assert placed.crowding == (3, 11) and time.monotonic() < give_up, placed
            await asyncio.sleep(0.05)
        assert await redis.zcard(keys.ASYNC_JOBS) == 10  # and left it as job_a3 was placed
        assert (await place(dispatcher, "job_alone", Admission(tenant="alpha"))).queue == QUEUE  # a one-tenant queue
        assert await redis.zcard(keys.ASYNC_JOBS) == 10  # which keeps no count of all tenants' jobs
        assert await redis.hget(keys.job_key("job_alone"), "counted") is None


async def test_near_its_maxmemory_two_tenants_sharing_the_queue_alike_both_keep_placing(redis: Redis) -> None:
    """Two tenants of the same weight, each holding half of the async jobs in Redis: neither holds more than its
    share, so in the band both still place (no third tenant is there to keep room for); the one that gets ahead
    is held until the other catches up."""
    dispatcher = await solo_dispatcher(redis, headroom=0.3)
    pair = {name: Admission(tenant=name, shared_weight=2.0) for name in ("alpha", "beta")}
    for n in range(2):
        for name in pair:
            assert (await place(dispatcher, f"job_{name}{n}", pair[name])).queue == QUEUE
    async with near_maxmemory(redis):
        assert (await place(dispatcher, "job_alpha2", pair["alpha"])).queue == QUEUE  # 2 of 4: its half
        assert (await place(dispatcher, "job_alpha3", pair["alpha"])).crowding == (3, 5)  # ahead: held
        assert (await place(dispatcher, "job_beta2", pair["beta"])).queue == QUEUE  # 2 of 5
        assert (await place(dispatcher, "job_alpha3", pair["alpha"])).queue == QUEUE  # 3 of 6: its half again


async def test_the_same_idempotency_key_in_two_tenants_names_two_jobs(redis: Redis, dispatcher: Dispatcher) -> None:
    claim = IdempotencyClaim("ticket-42", "d1")
    assert (await place(dispatcher, "job_a", Admission(tenant="a"), claim)).queue
    assert (await place(dispatcher, "job_b", Admission(tenant="b"), claim)).queue
    assert (await place(dispatcher, "job_a2", Admission(tenant="a"), claim)).held == "job_a:d1"
    assert await redis.hget(keys.job_key("job_b"), "tenant") == b"b"


async def test_the_rate_limit_allows_a_burst_then_one_request_per_interval(redis: Redis) -> None:
    limiter = TenantLimiter(redis)
    decisions = [await limiter.admit("a", 3) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert [d.remaining for d in decisions[:3]] == [2, 1, 0]
    refused = decisions[3]
    assert 0 < refused.retry_after <= 20.0  # one request per 60 / 3 s comes back
    assert refused.headers()["Retry-After"] in {str(n) for n in range(1, 21)}
    assert refused.headers()["RateLimit-Limit"] == "3" and refused.headers()["RateLimit-Remaining"] == "0"
    assert (await limiter.admit("b", 3)).allowed  # another tenant's budget is its own


async def test_the_backlog_counts_jobs_waiting_to_start_not_running_ones(redis: Redis, dispatcher: Dispatcher) -> None:
    reader = BacklogReader(redis, longest_job_seconds=600)
    store = JobStore(redis, result_ttl=60)
    assert (await reader.read([QUEUE]))[QUEUE] == Backlog(0, 0.0)
    for n in range(5):
        await place(dispatcher, f"job_{n}", Admission(tenant="a"))
    for n in range(2):
        assert await claim_and_start(redis, f"job_{n}.1", "solo") is not None
    assert await store.cancel("job_4", JobOutcome(status=JobStatus.cancelled, error={"error_type": "c",
                                                                                    "message": "m"}))
    backlog = (await reader.read([QUEUE]))[QUEUE]
    assert await redis.zcard(QUEUE) == 4  # arq's queue holds the running ones; the cancelled one was taken off
    assert backlog.waiting == 2 and 0 <= backlog.oldest_seconds < 5  # job_2 and job_3
