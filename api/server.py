"""The API's HTTP server: uvicorn's own Server and protocols, woken by signals instead of a 10 Hz tick.

`uvicorn.run` spends the server's life in `Server.main_loop`, which sleeps 0.1 s at a time to look at
`should_exit`. At rest those ten wake-ups a second were the API's whole idle cost and a third of the
stack's (0.2-0.45 CPU-ms each on a 2-vCPU VM; bench/RESULTS-cpu.md). `serve` runs the same Server through
its public `startup` and `shutdown` and, in between, waits for SIGINT or SIGTERM through the event loop's
signal handlers, so the process sleeps until a connection or a signal arrives.

What the tick did besides: it refreshed the `Date` header once a second; the app stamps its own instead
(`api.middleware.RequestContext`), so uvicorn's is switched off, and with it the `server: uvicorn`
header (it told a client only which software answers). Its `limit_max_requests` check is not used
here. A second signal during the graceful shutdown stops waiting for open connections, as a second
Ctrl-C does under `uvicorn.run`. Once started, the process's heap is frozen out of the garbage
collector's passes (common/heap.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import uvicorn

from common.heap import freeze_startup_heap

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(app: Any, on_stop: Callable[[], None] | None = None, **options: Any) -> None:
    """Serve `app` until SIGINT or SIGTERM; `on_stop` is called at the first signal; `options` are
    `uvicorn.Config`'s."""
    config = uvicorn.Config(app, date_header=False, server_header=False, **options)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve(uvicorn.Server(config), on_stop))


async def serve(server: uvicorn.Server, on_stop: Callable[[], None] | None = None) -> None:
    """Start `server`, sleep until a signal, then shut it down gracefully (bounded by the config's
    `timeout_graceful_shutdown`). `on_stop` runs, in the loop, at the first signal."""
    config = server.config
    if not config.loaded:
        config.load()
    server.lifespan = config.lifespan_class(config)
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            server.force_exit = True
        elif on_stop is not None:
            on_stop()
        server.should_exit = True
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    try:
        await server.startup()
        if server.started:
            freeze_startup_heap()  # the app, its schemas and the tokenizer exist now
            await stop.wait()
            await server.shutdown()
    finally:
        for signum in SIGNALS:
            loop.remove_signal_handler(signum)
