"""The API app factory: wires settings, the prompt compiler, Redis and the queue into FastAPI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from api.auth import KeyGate, RateGate, TenantKeys
from api.docs import install_docs
from api.errors import install_error_handlers
from api.jobs import router as jobs_router
from api.metrics import ApiMetrics
from api.middleware import BodyGate, RequestContext
from api.openapi import install_openapi
from api.preparation import JobPreparer
from api.queue_client import CompletionWaiter, JobQueue
from api.routes import router
from common.background import cancel_and_wait
from common.prompt import PromptCompiler
from common.queue.presence import ApiPresence, new_api_id
from common.queue.records import JobStore
from common.redis_connection import redis_connection, wait_reachable
from common.settings import Settings

ENDINGS_GRACE = 2.0  # seconds a stopping API waits for the endings of the sync jobs it cut short

DESCRIPTION = """A self-hosted, drop-in TypeSafe System One (Jev) decision API.

Each question is answered from the log-probabilities of single-token answer labels after one
shared prompt prefix: N questions cost one warm call plus N one-token branch calls.
Point any Jev client at this server's root URL."""


@dataclass
class Services:
    """What the routes need, built once per process."""

    settings: Settings
    preparer: JobPreparer
    queue: JobQueue
    started_at: float


def build_preparer(settings: Settings) -> JobPreparer:
    """Load the tokenizer named by the settings and verify its label alphabet."""
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer_source, settings.revision)
    return JobPreparer(settings, PromptCompiler.for_tokenizer(tokenizer, style=settings.prompt_style))


def create_app(settings: Settings, preparer: JobPreparer | None = None) -> FastAPI:
    """The openjev API. `preparer` may be injected (tests); otherwise it is built at startup. A keys file
    that cannot be used raises KeysFileError here, before anything is served."""
    keys = TenantKeys.load(settings.api_keys_file,
                           settings.api_key.get_secret_value() if settings.api_key is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_connection(settings)
        await wait_reachable(redis)
        waiter = CompletionWaiter(redis)
        await waiter.start()
        presence = ApiPresence(redis, new_api_id(), settings.api_presence_ttl)
        await presence.renew()  # before the first sync job names it
        watching = asyncio.create_task(keys.watch(), name="keys-file")
        present = asyncio.create_task(presence.keep(), name="presence")
        store = JobStore(redis, settings.job_result_ttl, settings.longest_job_seconds)
        app.state.services = Services(
            settings=settings,
            preparer=preparer or build_preparer(settings),
            queue=JobQueue(redis, store, waiter, settings.route_load_factor, settings.routing,
                           settings.redis_headroom, api_id=presence.api_id),
            started_at=time.time(),
        )
        try:
            yield
        finally:
            await app.state.services.queue.settle(ENDINGS_GRACE)
            watching.cancel()
            await cancel_and_wait(present)
            await presence.leave()
            await waiter.stop()
            await redis.aclose()

    app = FastAPI(title="openjev", version="0.1.0", description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.metrics = ApiMetrics(lambda: keys.directory.names)
    app.state.tenant_keys = keys
    app.state.stopping = asyncio.Event()  # set at the stop signal (api.server): see RequestContext
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(jobs_router)
    install_docs(app)
    install_openapi(app, settings)
    # Outermost first: the request id, then the key and the tenant's rate (before any body is read), then the
    # body gate.
    app.add_middleware(BodyGate, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    app.add_middleware(RateGate)
    app.add_middleware(KeyGate, keys=keys)
    app.add_middleware(RequestContext)
    return app
