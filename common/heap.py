"""The API's and the worker's heap once they have started: frozen out of the garbage collector's sight.

A started process holds a few hundred thousand objects that live as long as it does (modules, the
tokenizer, the FastAPI app and its schemas, arq and pydantic's machinery), and each of the collector's
full passes walked them all again: 4% of the API's CPU per README request went to `gc_collect_main`
(py-spy --native, bench/RESULTS-cpu.md). `gc.freeze` moves them to the permanent generation, which no
pass visits; what requests allocate is collected as before."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object still alive out of the collector's passes. Call at the end
    of a process's startup, once its long-lived objects exist."""
    gc.collect()
    gc.freeze()
