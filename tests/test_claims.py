"""A claim Redis breaks off costs no job slot and stops no worker (worker/wakeups.py). arq counts a job and
takes its semaphore before its claim's first command and then WATCHes the job's in-progress key; an error
between that WATCH and the MULTI (the connection lost, or Redis still loading its append-only file after a
restart, which accepts WATCH but answers EXISTS with LOADING) used to keep the slot taken for good (a
wake-up's claim) or end the worker's main loop (arq's poll's claim). CI once saw 46 of 50 jobs left queued
behind a worker whose slots had all gone that way after a `kill -9` of Redis (tests/test_durability.py).

Here a real arq `Worker` runs its own loop in-process against a real Redis through a relay that breaks off
the first claim it sees: the job still runs, the worker's loop is still running and its slot count is back
to zero."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import pytest_asyncio
from arq import Worker
from arq.connections import ArqRedis
from arq.worker import func

from common.jobs import deserialize, serialize
from common.redis_connection import redis_connection
from common.settings import Settings
from worker.fencing import RunningJobs
from worker.wakeups import WakeUps

pytestmark = pytest.mark.integration

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"


class ClaimBreaker:
    """A TCP relay to Redis that breaks off the first claim it relays: the EXISTS a connection sends after
    its WATCH is answered with `fault` instead ("lost": the connection is cut; "loading": Redis's LOADING
    error, as a Redis that is reading its append-only file answers it)."""

    def __init__(self, host: str, port: int, fault: str) -> None:
        self.upstream = (host, port)
        self.fault = fault
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
        watching = False
        try:
            while data := await client.read(65536):
                watching = watching or b"\r\nWATCH\r\n" in data
                if watching and b"\r\nEXISTS\r\n" in data and not self.broken.is_set():
                    self.broken.set()
                    if self.fault == "lost":
                        break
                    to_client.write(LOADING)  # the command never reaches Redis
                    continue
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


@pytest_asyncio.fixture(loop_scope="function", params=["lost", "loading"])
async def breaker(request: pytest.FixtureRequest, redis_server: str) -> AsyncIterator[tuple[ClaimBreaker, str]]:
    parts = urlsplit(redis_server)
    relay = ClaimBreaker(parts.hostname or "127.0.0.1", parts.port or 6379, request.param)
    await relay.start()
    yield relay, through(redis_server, relay.port)
    await relay.close()


async def test_a_claim_redis_breaks_off_gives_its_slot_back_and_the_job_still_runs(
        breaker: tuple[ClaimBreaker, str], redis, caplog: pytest.LogCaptureFixture) -> None:
    relay, url = breaker
    ran = asyncio.Event()

    async def probe(ctx: dict, payload: dict) -> None:
        ran.set()

    pool = redis_connection(Settings(redis_url=url), retries=20)
    worker = Worker(functions=[func(probe, name="probe")], queue_name="claims-test", redis_pool=pool, max_jobs=1,
                    poll_delay=0.05, keep_result=0, handle_signals=False, job_serializer=serialize,
                    job_deserializer=deserialize)
    wakeups = WakeUps(pool, "claims-test", worker, RunningJobs(), look_interval=0.05, listen=False)
    main = asyncio.create_task(worker.main())
    try:
        await wakeups.start()
        enqueuer = ArqRedis(connection_pool=redis.connection_pool, job_serializer=serialize)
        with caplog.at_level(logging.WARNING, logger="openjev.worker"):
            await enqueuer.enqueue_job("probe", {"id": "job_claimed"}, _queue_name="claims-test")
            await asyncio.wait_for(relay.broken.wait(), 10)  # the first claim was broken off ...
            await asyncio.wait_for(ran.wait(), 10)  # ... and the job ran all the same, on the one slot
        assert not main.done()  # arq's loop is still running
        assert any("broken off" in record.getMessage() for record in caplog.records)
        for task in list(worker.tasks.values()):
            await task
        assert worker.job_counter == 0  # no slot is held by a claim that ended
        assert worker.allow_pick_jobs is False  # arq's poll claims nothing: every claim is the guarded one
    finally:
        await wakeups.close()
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
        await worker.close()
