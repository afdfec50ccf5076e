"""The shared pub/sub listener (common/queue/subscriptions.py) behind the API's completion notices and
the worker's wake-ups, against a real Redis that is stopped and started again on its port: it
subscribes before `start` returns, outlives a Redis restart and a message its handler cannot take,
and lets go of its connection on `close`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common.queue.subscriptions import Subscription
from openjev.embedded_redis import RedisServer

CHANNEL = "openjev:test:subscription"
log = logging.getLogger("openjev.test")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    redis_server = RedisServer.on(tmp_path)
    redis_server.start()
    redis_server.wait_ready()
    try:
        yield redis_server
    finally:
        redis_server.stop()


async def published_until_heard(publisher: Redis, heard: list[bytes], message: bytes, timeout: float) -> float:
    """Publish `message` every 50 ms until the listener has it; returns how long that took."""
    started = time.monotonic()
    while message not in heard:
        assert time.monotonic() - started < timeout, f"{message!r} not heard within {timeout:g} s"
        await publisher.publish(CHANNEL, message)
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_it_is_subscribed_on_return_and_survives_a_redis_restart_and_a_bad_message(
        server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    heard: list[bytes] = []

    def on_message(data: bytes) -> None:
        if data == b"poison":
            raise ValueError("cannot take this one")
        heard.append(data)

    redis = Redis.from_url(server.url)
    publisher = Redis.from_url(server.url)
    subscription = Subscription(redis, CHANNEL, on_message, fallback="the test recheck carries on", log=log,
                                retry_delay=0.1, max_retry_delay=0.4, log_interval=0)  # each failure logged
    try:
        await subscription.start()
        assert await publisher.publish(CHANNEL, b"first") == 1  # one subscriber already, before any wait
        await published_until_heard(publisher, heard, b"first", timeout=5)

        assert await publisher.publish(CHANNEL, b"poison") == 1
        await published_until_heard(publisher, heard, b"after poison", timeout=5)
        assert "not handled" in caplog.text

        server.stop()
        deadline = time.monotonic() + 10
        while "resubscribing in 0.4 s" not in caplog.text:  # failed resubscriptions, backed off to the cap
            assert time.monotonic() < deadline, "the subscription's backoff never reached its cap"
            await asyncio.sleep(0.02)
        server.start()
        server.wait_ready()
        await publisher.aclose()
        publisher = Redis.from_url(server.url)
        took = await published_until_heard(publisher, heard, b"after restart", timeout=5)
        assert took < 2.0, took  # resubscribed within the cap of its backoff, not at some later schedule
        assert "subscription to openjev:test:subscription failed" in caplog.text
        assert "the test recheck carries on" in caplog.text
        assert "subscription to openjev:test:subscription works again" in caplog.text
    finally:
        await subscription.close()
        let_go_by = time.monotonic() + 2  # Redis drops a subscriber as it reads the closed socket
        while (await publisher.pubsub_numsub(CHANNEL)) != [(CHANNEL.encode(), 0)]:
            assert time.monotonic() < let_go_by, "the subscription's connection is still subscribed"
            await asyncio.sleep(0.02)
        await publisher.aclose()
        await redis.aclose()


async def test_through_an_outage_it_warns_once_and_says_when_it_is_subscribed_again(
        server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Resubscribing every 50 ms while Redis is down, the log keeps to the first failure (then one every
    10 s), and one line once the subscription is back, with the count of failed tries."""
    caplog.set_level(logging.INFO, logger=log.name)
    heard: list[bytes] = []
    redis = Redis.from_url(server.url)
    subscription = Subscription(redis, CHANNEL, heard.append, fallback="the test recheck carries on", log=log,
                                retry_delay=0.05, max_retry_delay=0.05)
    publisher = Redis.from_url(server.url)
    try:
        await subscription.start()
        await published_until_heard(publisher, heard, b"before", timeout=5)
        await publisher.aclose()
        server.stop()
        deadline = time.monotonic() + 10
        while subscription.failures < 10:  # ten failed tries to subscribe again
            assert time.monotonic() < deadline, f"{subscription.failures} failures in 10 s"
            await asyncio.sleep(0.02)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and CHANNEL in r.getMessage()]
        assert len(warned) == 1, caplog.text
        assert "the test recheck carries on; resubscribing in 0.05 s" in warned[0].getMessage()
        server.start()
        server.wait_ready()
        publisher = Redis.from_url(server.url)
        await published_until_heard(publisher, heard, b"after", timeout=5)
        assert subscription.failures == 0
        back = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
        assert len(back) == 1 and back[0].startswith(f"subscription to {CHANNEL} works again after "), back
    finally:
        await subscription.close()
        await publisher.aclose()
        await redis.aclose()
