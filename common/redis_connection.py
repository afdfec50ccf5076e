"""The one place a Redis client is built from the settings: the Redis at OPENJEV_REDIS_URL, or the master
that the Sentinels of OPENJEV_REDIS_SENTINELS name. Through Sentinels every new connection asks them
where the master is, so after a failover each process reconnects to the new master by itself."""

from __future__ import annotations

from arq.connections import ArqRedis, RedisSettings
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ConstantBackoff, ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.jobs import deserialize, serialize
from common.settings import Settings

CONNECT_TIMEOUT = 2.0  # seconds to open a connection to Redis or to a Sentinel
SENTINEL_TIMEOUT = 1.0  # seconds a Sentinel has to answer where the master is; then the next one is asked
# What a retry rides over: a lost connection (Redis restarted, or a master died and the next connection
# asks the Sentinels again), never an error Redis answered with but a full Redis's refusal (RETRY_ON_FULL).
# redis-py retries a connection attempt that fails with a socket's OSError against the same address, before
# it becomes a ConnectionError: that is what waits out a restarted Redis, but through Sentinels it would
# knock at a dead master for the whole budget, so there only redis-py's own errors are retried (each retry
# asks the Sentinels again).
RETRY_ON = (RedisConnectionError, RedisTimeoutError)
RETRY_ON_SOCKET = (*RETRY_ON, OSError)
# A worker also waits out a Redis at its maxmemory (noeviction), which refuses writes until finished jobs'
# keys expire or the limit is raised: arq's own transactions (its poll's read of cancellations, a job's
# start and finish) are refused whole inside MULTI, and an error there would end arq's poll loop and the
# worker with it. The worker's scripts see the refusal as an error of their own and try again as they do.
RETRY_ON_FULL = (OutOfMemoryError,)
STARTUP_ATTEMPTS = 6  # a process starting beside its Redis waits for it this many seconds


def redis_connection(settings: Settings, retries: int = 0) -> ArqRedis:
    """A client (arq's, with openjev's JSON job serializer) on the queue's Redis; connects lazily.

    `retries`: how many times a command is sent again over a lost connection or to a full Redis, backing
    off to 1 s (0: the error is raised at once).
    """
    dsn = RedisSettings.from_dsn(settings.redis_url)
    password = dsn.password or (settings.redis_password.get_secret_value() if settings.redis_password else None)
    options = {"db": dsn.database, "username": dsn.username, "password": password, "ssl": dsn.ssl,
               "socket_connect_timeout": CONNECT_TIMEOUT, "socket_keepalive": True}
    if retries:
        errors = (*(RETRY_ON if settings.redis_sentinels else RETRY_ON_SOCKET), *RETRY_ON_FULL)
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries, supported_errors=errors)
        options |= {"retry": retry, "retry_on_error": list(errors)}
    if settings.redis_sentinels:
        # Sentinels that require a password take the queue's; they answer or are skipped within a second.
        sentinel_options = {"password": password, "socket_timeout": SENTINEL_TIMEOUT,
                            "socket_connect_timeout": SENTINEL_TIMEOUT}
        sentinels = Sentinel(settings.redis_sentinels, sentinel_kwargs=sentinel_options)
        client = sentinels.master_for(settings.redis_sentinel_master, redis_class=ArqRedis, **options)
    else:
        client = ArqRedis(host=dsn.host, port=dsn.port, **options)
    client.job_serializer = serialize
    client.job_deserializer = deserialize
    return client


def out_of_memory(error: BaseException) -> bool:
    """Whether Redis refused a write at its maxmemory: redis-py's OutOfMemoryError for a command, or a script's
    error carrying that refusal (Redis 6 reports it as "Error running script ...: -OOM command not allowed")."""
    return isinstance(error, OutOfMemoryError) or (
        isinstance(error, ResponseError) and "OOM command not allowed" in str(error))


def redis_address(settings: Settings) -> str:
    """Where the queue's Redis is, without its password: what may be logged."""
    if settings.redis_sentinels:
        hosts = ",".join(f"{host}:{port}" for host, port in settings.redis_sentinels)
        return f"master {settings.redis_sentinel_master!r} of the Sentinels {hosts}"
    dsn = RedisSettings.from_dsn(settings.redis_url)
    return f"redis://{dsn.host}:{dsn.port}/{dsn.database}"


async def wait_reachable(redis: ArqRedis, attempts: int = STARTUP_ATTEMPTS) -> None:
    """Return once Redis answers a PING; raise its last error after `attempts` tries a second apart
    (as arq's `create_pool` does at a process's start)."""
    startup = Retry(ConstantBackoff(1.0), attempts - 1, supported_errors=RETRY_ON)
    await startup.call_with_retry(redis.ping, _ignore)


async def _ignore(_error: Exception) -> None:
    return None
