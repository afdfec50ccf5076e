"""Claims (common/queue/claims.py, worker/wakeups.py): a claim Redis breaks off costs no job slot, stops no
worker and loses no job. arq's own claim counts a job and takes its semaphore before its first command and
then WATCHes the job's in-progress key; an error between that WATCH and the MULTI (the connection lost, or
Redis still loading its append-only file after a restart, which accepts WATCH but answers EXISTS with
LOADING) kept the slot taken for good (a wake-up's claim) or ended the worker's main loop (arq's poll's
claim). CI once saw 46 of 50 jobs left queued behind a worker whose slots had all gone that way after a
`kill -9` of Redis (tests/test_durability.py). The worker's claim is now one script, and a slot is counted
only once it succeeded.

A real arq `Worker` runs its own loop in-process against a real Redis through a relay that breaks off the
first claim it sees, three ways: the job still runs, the worker's loop is still running and its slot count
is back to zero."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import pytest_asyncio
from arq import Worker
from arq.connections import ArqRedis
from arq.worker import func

from common.jobs import deserialize, serialize
from common.queue.membership import WorkerCounters
from common.redis_connection import redis_connection
from common.settings import Settings
from worker.fencing import RunningJobs
from worker.wakeups import WakeUps

pytestmark = pytest.mark.integration

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"


class ClaimBreaker:
    """A TCP relay to Redis that breaks off the first claim of `job_id` it relays (the EVALSHA naming it):
    "lost", the connection is cut before the claim reaches Redis; "loading", Redis's LOADING error answers
    it instead, as a Redis reading its append-only file answers; "reply lost", Redis runs the claim and the
    connection is cut before its reply is relayed."""

    def __init__(self, host: str, port: int, fault: str, job_id: bytes) -> None:
        self.upstream = (host, port)
        self.fault = fault
        self.job_id = job_id
        self.broken = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _relay(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        upstream, to_upstream = await asyncio.open_connection(*self.upstream)
        back = asyncio.create_task(self._pump(upstream, to_client))
        try:
            while data := await client.read(65536):
                if b"EVALSHA" in data and self.job_id in data and not self.broken.is_set():
                    self.broken.set()
                    if self.fault == "loading":
                        to_client.write(LOADING)  # the claim never reaches Redis
                        continue
                    if self.fault == "reply lost":
                        back.cancel()
                        await asyncio.gather(back, return_exceptions=True)
                        to_upstream.write(data)
                        await upstream.read(65536)  # Redis ran the claim; its reply goes nowhere
                    break
                to_upstream.write(data)
                await to_upstream.drain()
        except ConnectionError:
            pass
        finally:
            back.cancel()
            to_upstream.close()
            to_client.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()


def through(url: str, port: int) -> str:
    """`url` with its port replaced by the relay's (credentials and database kept)."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"))


JOB_ID = "job_claimed.1"


@pytest_asyncio.fixture(loop_scope="function", params=["lost", "loading", "reply lost"])
async def breaker(request: pytest.FixtureRequest, redis_server: str) -> AsyncIterator[tuple[ClaimBreaker, str]]:
    parts = urlsplit(redis_server)
    relay = ClaimBreaker(parts.hostname or "127.0.0.1", parts.port or 6379, request.param, JOB_ID.encode())
    await relay.start()
    yield relay, through(redis_server, relay.port)
    await relay.close()


async def test_a_claim_redis_breaks_off_costs_no_slot_and_the_job_still_runs(
        breaker: tuple[ClaimBreaker, str], redis, caplog: pytest.LogCaptureFixture) -> None:
    relay, url = breaker
    ran = asyncio.Event()

    async def probe(ctx: dict, payload: dict) -> None:
        ran.set()

    pool = redis_connection(Settings(redis_url=url), retries=20)
    worker = Worker(functions=[func(probe, name="probe")], queue_name="claims-test", redis_pool=pool, max_jobs=1,
                    poll_delay=0.05, keep_result=0, handle_signals=False, job_serializer=serialize,
                    job_deserializer=deserialize)
    wakeups = WakeUps(pool, "claims-test", worker, RunningJobs(), worker_id="w-claims", look_interval=0.05,
                      unseen_before=16.0, counters=WorkerCounters(), sync_deadline=120.0, listen=False)
    assert worker.in_progress_timeout_s > 60  # a claim left standing would hold the job well past this test
    main = asyncio.create_task(worker.main())
    try:
        await wakeups.start()
        enqueuer = ArqRedis(connection_pool=redis.connection_pool, job_serializer=serialize)
        with caplog.at_level(logging.WARNING, logger="openjev.worker"):
            await enqueuer.enqueue_job("probe", {"id": "job_claimed"}, _queue_name="claims-test", _job_id=JOB_ID)
            await asyncio.wait_for(relay.broken.wait(), 10)  # the first claim was broken off ...
            await asyncio.wait_for(ran.wait(), 10)  # ... and the job ran all the same, on the one slot
        assert not main.done()  # arq's loop is still running
        for task in list(worker.tasks.values()):
            await task
        assert worker.job_counter == 0  # no slot is held by a claim that ended
        assert worker.allow_pick_jobs is False  # arq's poll claims nothing: every claim is the worker's script
        assert await redis.zcard("claims-test") == 0  # and arq finished it
    finally:
        await wakeups.close()
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
        await worker.close()


async def test_a_claim_is_taken_once_and_only_when_due_and_not_held_by_another_process(redis) -> None:
    """The claim script's rules (common/queue/claims.py), against a real Redis: a queued, due placement is
    claimed with its score and its job started; a second claim by the same process takes it again (its reply
    was lost); another process's claim, a deferred placement and one no longer queued are left alone; a
    placement its record no longer names is claimed (for arq to finish) but its job is not started."""
    from arq.utils import timestamp_ms

    from common.queue import keys
    from common.queue.claims import Claims

    now = timestamp_ms()
    await redis.zadd("claims-rules", {"job_due.1": now - 5, "job_later.1": now + 60_000, "job_other.1": now - 5,
                                      "job_moved.1": now - 5})
    for job, placement in (("job_due", "job_due.1"), ("job_moved", "job_moved.2")):
        await redis.hset(keys.job_key(job), mapping={"status": "queued", "placement": placement,
                                                     "created_at": time.time() - 2, "deadline_at": time.time() + 30})
    mine, theirs = (Claims(redis, "claims-rules", "w-rules", 30.0, unseen_before=16.0) for _ in range(2))
    assert mine.holder != theirs.holder  # one worker id, two processes
    claimed = await mine.claim("job_due.1")
    assert claimed is not None and claimed.score == now - 5
    assert claimed.started is not None and claimed.started.attempts == 1 and 1.5 < claimed.started.waited < 10
    assert 20 < claimed.started.remaining <= 30
    record = await redis.hgetall(keys.job_key("job_due"))
    assert (record[b"status"], record[b"worker"], record[b"attempts"]) == (b"running", b"w-rules", b"1")
    assert await redis.get(keys.ARQ_IN_PROGRESS + "job_due.1") == mine.holder.encode()
    assert 29_000 < await redis.pttl(keys.ARQ_IN_PROGRESS + "job_due.1") <= 30_000
    assert await theirs.claim("job_due.1") is None  # held by another process
    again = await mine.claim("job_due.1")  # its own claim, taken again
    assert again is not None and again.score == now - 5 and again.started is not None
    assert await mine.claim("job_later.1") is None  # deferred: not due on this clock
    assert not await redis.exists(keys.ARQ_IN_PROGRESS + "job_later.1")
    assert await mine.claim("job_gone.1") is None  # not queued
    await redis.set(keys.ARQ_IN_PROGRESS + "job_other.1", b"1")  # arq's own claim, from another process
    assert await mine.claim("job_other.1") is None
    moved = await mine.claim("job_moved.1")  # its record names placement 2 now
    assert moved is not None and moved.started is None
    assert (await redis.hget(keys.job_key("job_moved"), "status")) == b"queued"


async def queue_jobs_of_a_live_and_a_dead_api(redis, queue: str) -> None:
    """Four placements waiting on `queue`, as the placement script leaves them, for tenant "acme": sync jobs of a
    dead API (job_dead_api, placed 30 s ago; job_dead_api_recent, 2 s ago), a sync job of a live API placed 30 s
    ago (job_live_api), and an async job placed 30 s ago (job_async)."""
    from common.queue import keys

    now = time.time()
    await redis.set(keys.api_key("api-live"), "1", px=20_000)
    await redis.delete(keys.api_key("api-dead"))
    jobs = {  # job id -> (kind, api, seconds waited)
        "job_dead_api": ("sync", "api-dead", 30), "job_live_api": ("sync", "api-live", 30),
        "job_dead_api_recent": ("sync", "api-dead", 2), "job_async": ("async", None, 30)}
    for job_id, (kind, api, waited) in jobs.items():
        placement = f"{job_id}.1"
        await redis.zadd(queue, {placement: 0})
        await redis.zadd(queue + ":waiting", {placement: now - waited})
        await redis.set(keys.ARQ_JOB + placement, b"payload", px=60_000)
        await redis.zadd(keys.tenant_key("acme", "jobs"), {job_id: now + 60})
        await redis.hset(keys.job_key(job_id), mapping={
            "status": "queued", "placement": placement, "kind": kind, "tenant": "acme", "queue": queue,
            "created_at": now - waited, "deadline_at": now + 60, **({"api": api} if api else {})})


async def test_a_sync_job_that_waited_past_its_apis_presence_ends_instead_of_starting_once_that_api_is_gone(
        redis) -> None:
    """common/queue/presence.py: a claimed sync job that has waited `unseen_before` seconds or more starts only
    while the key of the API waiting for it is there. Without it, the job ends as cancelled with the 503 a
    reader alive after all would answer, the notice carries that outcome, the job leaves its tenant's count
    and the placement leaves the queue with its arq keys. A sync job that waited less, one whose API is live,
    and an async job start as before."""
    import orjson

    from common.jobs import JobOutcome
    from common.queue import keys
    from common.queue.claims import Claims
    from common.queue.presence import GONE_OUTCOME

    queue = "claims-presence"
    await queue_jobs_of_a_live_and_a_dead_api(redis, queue)
    claims = Claims(redis, queue, "w-presence", 30.0, unseen_before=16.0)
    notices = redis.pubsub(ignore_subscribe_messages=True)
    await notices.subscribe(keys.DONE_CHANNEL)
    try:
        gone = await claims.claim("job_dead_api.1")
        notice = None
        give_up = time.monotonic() + 5
        while notice is None and time.monotonic() < give_up:  # the subscription's own reply comes first, as None
            notice = await notices.get_message(timeout=1)
    finally:
        await notices.aclose()
    assert gone is not None and gone.gone and gone.started is None
    record = await redis.hgetall(keys.job_key("job_dead_api"))
    assert record[b"status"] == b"cancelled" and record[b"ended_by"] == b"job_dead_api.1"
    outcome = JobOutcome.model_validate_json(record[b"outcome"])
    assert outcome.http_status == 503 and "API process" in outcome.error["message"]
    assert 0 < await redis.ttl(keys.job_key("job_dead_api")) <= 15
    assert notice is not None and notice["data"] == b"job_dead_api cancelled " + GONE_OUTCOME.encode()
    assert orjson.loads(notice["data"].split(b" ", 2)[2])["status"] == "cancelled"
    assert await redis.zscore(keys.tenant_key("acme", "jobs"), "job_dead_api") is None
    assert await redis.zscore(queue, "job_dead_api.1") is None  # nothing of it is left for arq to run
    assert await redis.zscore(queue + ":waiting", "job_dead_api.1") is None
    assert not await redis.exists(keys.ARQ_JOB + "job_dead_api.1", keys.ARQ_IN_PROGRESS + "job_dead_api.1")
    for job_id in ("job_live_api", "job_dead_api_recent", "job_async"):
        claimed = await claims.claim(f"{job_id}.1")
        assert claimed is not None and not claimed.gone and claimed.started is not None, job_id
        assert await redis.hget(keys.job_key(job_id), "status") == b"running"
        assert await redis.zscore(keys.tenant_key("acme", "jobs"), job_id) is not None


async def test_a_look_at_the_queue_ends_and_takes_off_the_waiting_sync_jobs_of_a_gone_api(redis) -> None:
    """The worker's regular look (claims.py `look`) ends the placements waiting on its queue whose jobs are sync
    jobs of a gone API, as a claim would, before the worker reaches them: they leave the queue, its waiting set
    (the backlog /metrics reports) and their tenant's count at once. The others are due as before. A placement
    waiting longer than a sync job lives (an async backlog) is not read."""
    from common.queue import keys
    from common.queue.claims import Claims

    queue = "claims-look"
    await queue_jobs_of_a_live_and_a_dead_api(redis, queue)
    # Waiting longer than a sync job lives: the look reads no such placement (its claim ends it all the same).
    await redis.zadd(queue, {"job_older.1": 0})
    await redis.zadd(queue + ":waiting", {"job_older.1": time.time() - 200})
    await redis.hset(keys.job_key("job_older"), mapping={
        "status": "queued", "placement": "job_older.1", "kind": "sync", "api": "api-dead", "tenant": "acme",
        "queue": queue, "created_at": time.time() - 200, "deadline_at": time.time() + 60})
    claims = Claims(redis, queue, "w-look", 30.0, unseen_before=16.0, sync_deadline=120.0)
    looked = await claims.look(limit=100)
    assert looked.gone == ["job_dead_api.1"]
    assert sorted(arq_job_id for arq_job_id, _ in looked.due) == [
        "job_async.1", "job_dead_api_recent.1", "job_live_api.1", "job_older.1"]
    assert await redis.hget(keys.job_key("job_older"), "status") == b"queued"
    assert await redis.hget(keys.job_key("job_dead_api"), "status") == b"cancelled"
    assert await redis.zscore(queue, "job_dead_api.1") is None
    assert await redis.zscore(queue + ":waiting", "job_dead_api.1") is None
    assert not await redis.exists(keys.ARQ_JOB + "job_dead_api.1")
    assert await redis.zscore(keys.tenant_key("acme", "jobs"), "job_dead_api") is None
    for job_id in ("job_live_api", "job_dead_api_recent", "job_async"):  # untouched
        assert await redis.hget(keys.job_key(job_id), "status") == b"queued"
        assert await redis.zscore(queue + ":waiting", f"{job_id}.1") is not None
    assert (await claims.look(limit=100)).gone == []
    assert (await claims.claim("job_older.1")).gone  # its claim looks at its API whatever its age
