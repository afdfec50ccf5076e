"""Waiting for a replica's copy: a Redis master replicates asynchronously, so a write it acknowledged
is lost if it dies before a replica has it, and a Sentinel failover then promotes a replica without it.
Where a promise rests on a write (an async job's 202, a stored outcome), its writer waits here first."""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ReadOnlyError, ResponseError

from common.queue import keys

log = logging.getLogger("openjev.queue")

REPLICA_WAIT = 2.0  # seconds a promise waits for a replica's copy; then it is given anyway (logged)
MARK_TTL_MS = 60_000  # the mark only carries a replication offset; it need not outlive a minute
ALONE_RECHECK = 1.0  # seconds a master found without replicas is believed so before INFO asks again
# Seconds promises go without waiting once a replica failed to confirm within REPLICA_WAIT. A replica that
# stalls or is cut off stays connected for the master until its repl-timeout (60 s by default): without
# this, every 202 and every stored outcome would wait the full REPLICA_WAIT meanwhile, holding a worker's
# job slot for it. With it, one promise in each window tries again.
LAGGING_RECHECK = 5.0


class ReplicaCopy:
    """Redis's replicas, as the master reports them."""

    def __init__(self, redis: Redis, timeout: float = REPLICA_WAIT, lagging_recheck: float = LAGGING_RECHECK) -> None:
        """`redis`: the master's client; `timeout`: the longest a `wait` blocks; `lagging_recheck`: how long
        promises go without waiting after a wait timed out."""
        self.redis = redis
        self.timeout_ms = int(timeout * 1000)
        self.lagging_recheck = lagging_recheck
        self.readable = True  # False once INFO or WAIT was refused (a managed Redis may forbid them)
        # Until when (time.monotonic()) the master is taken to have no replica: a lone Redis (serve, compose)
        # is asked once a second, not once per promise. A replica that attaches meanwhile starts from a copy
        # of everything written before, so a promise given in that second loses nothing a check would have.
        self._alone_until = 0.0
        # Until when the replicas are taken to lag (a wait timed out): promises are given without waiting.
        self._lagging_until = 0.0
        self._given_unconfirmed = 0  # promises given without a wait while lagging, for the log

    async def wait(self) -> bool:
        """Return once every write Redis acknowledged before this call is on at least one replica;
        True if so; False at once when the master has no replica (or had none within ALONE_RECHECK
        seconds, or refuses INFO or WAIT) or a wait timed out within `lagging_recheck` seconds, and
        after the timeout (logged: the promise is given all the same)."""
        now = time.monotonic()
        if not self.readable or now < self._alone_until:
            return False
        if now < self._lagging_until:
            self._given_unconfirmed += 1
            return False
        try:
            info = await self.redis.info("replication")
            if info.get("role") != "master" or not info.get("connected_slaves"):
                self._alone_until = time.monotonic() + ALONE_RECHECK
                return False  # one INFO a second at most, and no wait, where nothing replicates
            # WAIT counts the writes of its own connection: a pipeline (one connection, sent again
            # whole after a lost connection) writes a mark, which follows every earlier write in the
            # replication stream, and waits for a replica to confirm it.
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.REPLICATION_MARK, b"", px=MARK_TTL_MS)
                pipe.wait(1, self.timeout_ms)
                _, copies = await pipe.execute()
        except ReadOnlyError:  # a demoted master, seen before the connection is closed
            return False
        except ResponseError as exc:
            self.readable = False
            log.warning("Redis refuses INFO replication or WAIT (%s): promises are given without waiting "
                        "for a replica", exc)
            return False
        if copies < 1:
            if time.monotonic() < self._lagging_until:  # a wait beside this one timed out and said so
                self._given_unconfirmed += 1
                return False
            given, self._given_unconfirmed = self._given_unconfirmed, 0
            since = f" ({given} more given without waiting since the last try)" if given else ""
            log.warning("no replica confirmed a write within %.1f s; the promise is given anyway, and those "
                        "of the next %g s without waiting%s", self.timeout_ms / 1000, self.lagging_recheck, since)
            self._lagging_until = time.monotonic() + self.lagging_recheck
            return False
        if self._lagging_until:
            log.info("a replica confirms writes again; %d promises were given without waiting meanwhile",
                     self._given_unconfirmed)
            self._lagging_until, self._given_unconfirmed = 0.0, 0
        return True
