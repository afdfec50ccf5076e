"""One pub/sub channel, listened to for as long as a process runs. Notices on a channel only make a process
act sooner (the API's completion notices, the worker's wake-ups): each has a fallback that reads the
truth from Redis on a schedule (the API's record recheck, the worker's look at its queue and arq's poll
of aborts). So a lost subscription is logged and taken again, backing off while Redis stays away, and
never ends the listener or its process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from common.background import cancel_and_wait
from common.logs import RepeatedFailure


class Subscription:
    """Hands every message on `channel` to `on_message`, resubscribing after a Redis error: first
    after `retry_delay` seconds, doubling up to `max_retry_delay` while the errors go on. `fallback`
    says in the log what covers the gap; the log has the first failure, then one every `log_interval` s at
    most, and a line once it is subscribed again (common/logs.py RepeatedFailure)."""

    def __init__(self, redis: Redis, channel: str, on_message: Callable[[bytes], None], *, fallback: str,
                 log: logging.Logger, retry_delay: float = 0.5, max_retry_delay: float = 30.0,
                 log_interval: float = 10.0) -> None:
        self.redis = redis
        self.channel = channel
        self._on_message = on_message
        self._fallback = fallback
        self._log = log
        self._failures = RepeatedFailure(log, f"subscription to {channel}", log_interval)
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Send SUBSCRIBE before returning (a notice published afterwards reaches us), then listen in
        the background. A Redis that refuses now is retried there."""
        try:
            self._pubsub = await self._subscribe()
        except (RedisError, OSError) as exc:
            self._failures.failed(exc, f"{self._fallback}; retrying in {self._retry_delay:g} s")
        self._task = asyncio.create_task(self._listen(), name=f"listen {self.channel}")

    @property
    def failures(self) -> int:
        """Failed tries to subscribe or listen since the last time it subscribed (0 while it listens)."""
        return self._failures.failures

    def stop(self) -> None:
        """Hand on nothing more."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        """Stop, and release the subscription's connection."""
        await cancel_and_wait(self._task)
        await self._drop()

    async def _subscribe(self) -> PubSub:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
            raise
        return pubsub

    async def _drop(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()
            self._pubsub = None

    def _hand_on(self, data: bytes) -> None:
        try:
            self._on_message(data)
        except Exception:  # one bad message must not end the listening
            self._log.exception("message on %s not handled: %r", self.channel, data[:200])

    async def _listen(self) -> None:
        delay = self._retry_delay
        while True:
            try:
                if self._pubsub is None:
                    self._pubsub = await self._subscribe()
                    self._failures.succeeded()
                    delay = self._retry_delay
                async for message in self._pubsub.listen():
                    self._hand_on(message["data"])
            except (RedisError, OSError) as exc:
                self._failures.failed(exc, f"{self._fallback}; resubscribing in {delay:g} s")
                await self._drop()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_retry_delay)
