"""The `openjev` command: the one composition root that starts the API, workers and engines."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from common.settings import get_settings


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openjev", description="Self-hosted TypeSafe System One (Jev) API.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the whole stack here: Redis, engine(s), worker(s) and the API")
    serve.add_argument("--host", default="127.0.0.1", help="API bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    engine = serve.add_mutually_exclusive_group()
    engine.add_argument("--connect", metavar="URL", help="use a running SGLang server instead of the CPU engine")
    engine.add_argument("--sglang-python", metavar="PATH", help="launch SGLang with this Python interpreter")
    serve.add_argument("--workers", type=int, default=1, help="worker + CPU engine pairs (a local fake fleet)")
    serve.add_argument("--compute-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    serve.set_defaults(run=_serve)

    api = sub.add_parser("api", help="run the HTTP API alone (needs Redis and live workers)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.set_defaults(run=_api)

    worker = sub.add_parser("worker", help="run one queue worker beside its engine (OPENJEV_ENGINE_URL)")
    worker.set_defaults(run=_worker)

    eng = sub.add_parser("engine", help="run the reference CPU engine (SGLang's /generate subset)")
    eng.add_argument("--host", default="127.0.0.1")
    eng.add_argument("--port", type=int, default=30000)
    eng.add_argument("--model", default=None, help="a converted model dir (default: SmolLM2-135M-Instruct)")
    eng.add_argument("--cache-dir", type=Path, default=None, help="where converted models live")
    eng.add_argument("--compute-delay", type=float, default=0.0, help="seconds to stall each request (tests)")
    eng.set_defaults(run=_engine)

    schema = sub.add_parser("schema", help="print the OpenAPI schema (no model, no network)")
    schema.set_defaults(run=_schema)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from openjev.serve import ServeOptions, Supervisor

    options = ServeOptions(host=args.host, port=args.port, connect=args.connect, sglang_python=args.sglang_python,
                           workers=args.workers, compute_delay=args.compute_delay)
    return Supervisor(get_settings(), options).run()


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app

    uvicorn.run(create_app(get_settings()), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0


def _worker(_: argparse.Namespace) -> int:
    from worker.runner import run_worker

    return run_worker(get_settings())


def _engine(args: argparse.Namespace) -> int:
    from worker.cpu_engine.server import run

    cache_dir = args.cache_dir or get_settings().cache_dir / "models"
    run(args.host, args.port, args.model, cache_dir, compute_delay=args.compute_delay)
    return 0


def _schema(_: argparse.Namespace) -> int:
    from api.app import create_app

    json.dump(create_app(get_settings()).openapi(), sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0
