"""`openjev serve`: the whole stack on one machine as a supervised process group. An embedded
Redis, the engine(s), one worker per engine and the API. A worker that dies is restarted (its jobs
wait in Redis), and so is Redis, in place (same port, data directory and password; its append-only
file keeps the jobs). If an engine or the API dies, or a worker exits because its engine stopped
answering (status 3, e.g. a `--connect` engine), everything stops and serve exits non-zero so a
container platform replaces it."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from common.contract import EXAMPLE_REQUEST
from common.redis_connection import redis_address
from common.settings import Settings
from openjev.embedded_redis import DataDirInUse, RedisServer, free_port
from worker.runner import EXIT_ENGINE_DOWN

CPU_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENGINE_START_TIMEOUT = 1800.0  # the CPU engine's first start converts the GGUF (minutes for a 1.5B model)
SGLANG_START_TIMEOUT = 2400.0  # SGLang's first start downloads the weights; every start captures CUDA graphs
SGLANG_STOP_TIMEOUT = 30.0  # SGLang stops its scheduler and detokenizer before it exits; a busy CPU slows that
SECRETS_NEEDED = {  # the secrets in serve's environment that each child needs; the others are kept from it
    "api": {"OPENJEV_API_KEY", "OPENJEV_REDIS_URL", "OPENJEV_REDIS_PASSWORD", "OPENJEV_JOB_ID_SECRET"},  # the URL
    # (or the password setting) holds Redis's password
    "worker": {"OPENJEV_REDIS_URL", "OPENJEV_REDIS_PASSWORD", "OPENJEV_BACKEND_API_KEY"},
    "engine": {"OPENJEV_BACKEND_API_KEY"},
}
SECRETS = set().union(*SECRETS_NEEDED.values())
RESTART_LIMIT = 20  # restarts within a minute before serve gives up on a crash-looping worker or Redis
STOP_TIMEOUT = 7.0  # on Ctrl-C or SIGTERM: a child (SGLang aside) still running after this is killed
REDIS_STOP_TIMEOUT = 2.0  # then Redis, last, writes its file and exits (ms at rest): serve is gone within 10 s
PROGRESS_INTERVAL = 10.0  # seconds between "still loading" lines while a child starts
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "first-request.json"  # the README's first request


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    restart: str | None = None  # restarted when it dies, for this reason (logged); otherwise its death stops the group
    gives_up_with: int | None = None  # an exit status that stops the group even so (a worker's engine is down)
    launch: Callable[[], subprocess.Popen[bytes]] | None = None  # how to start it, when not `argv` with `env`
    process: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    own_group: bool = False  # started as its own process group, so stopping it reaches every process it forked

    def start(self) -> None:
        # Never in serve's process group: a terminal's Ctrl-C reaches serve alone, which then stops each
        # child once (a second signal makes uvicorn cancel its lifespan and print a traceback).
        self.process = self.launch() if self.launch else subprocess.Popen(
            self.argv, env=self.env, start_new_session=self.own_group, process_group=None if self.own_group else 0)

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` s; with `own_group`, to the whole group, and the group is
        killed even when its leader exits in time (SGLang's scheduler and detokenizer are its children)."""
        self.terminate()
        self.wait_or_kill(time.monotonic() + timeout)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM), without waiting."""
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        """Wait for it to exit until `deadline` (monotonic), then SIGKILL it (with `own_group`, its group)."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            process.wait()
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        assert self.process is not None
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    connect: str | None = None
    sglang_python: str | None = None
    workers: int = 1
    compute_delay: float = 0.0
    shared_redis: bool = False  # use OPENJEV_REDIS_URL (shared by several serve instances), not an embedded one
    sglang_args: list[str] = field(default_factory=list)  # passed through to SGLang after the launcher's flags
    cpu_model: str | None = None  # a CPU engine catalog name (worker/cpu_engine/model.py); None: SmolLM2


class Supervisor:
    """Starts the children in order and watches them until a signal or a fatal death."""

    def __init__(self, settings: Settings, options: ServeOptions) -> None:
        self.settings = settings
        self.options = options
        self.children: list[Child] = []
        self._stopping = False

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        try:
            return self._run()
        finally:
            self._stop_all()

    def _run(self) -> int:
        env = self._base_env(self._redis())
        # With SGLang the API starts first: a platform sees the port open at once and clients get 503 with
        # Retry-After while the model loads. The CPU engine must first convert the model the API tokenizes with.
        api_first = bool(self.options.connect or self.options.sglang_python)
        if api_first:
            self._spawn_api(env)
        engine_urls = self._engines(env)
        if engine_urls is None:
            return 0 if self._stopping else 1
        prefix = (self.settings.worker_id or socket.gethostname()) if self.options.shared_redis else "local"
        for i, url in enumerate(engine_urls):
            self._spawn(Child(f"worker-{i}", _openjev("worker"),
                              child_env("worker", env) | {"OPENJEV_ENGINE_URL": url,
                                                          "OPENJEV_WORKER_ID": f"{prefix}-{i}"},
                              restart="its jobs wait in Redis", gives_up_with=EXIT_ENGINE_DOWN))
        if not api_first:
            self._spawn_api(env)
        if not self._wait_ready():
            return 0 if self._stopping else 1
        url = f"http://{self._display_host()}:{self.options.port}"
        print(f"openjev is serving on {url}  (docs: {url}/, Ctrl-C stops it)\n  try: {self._try_command(url)}",
              flush=True)
        return self._watch()

    def _try_command(self, url: str) -> str:
        """A curl line that works from any directory, with the key's header (never the key) when one is set."""
        body = f"@{EXAMPLE}" if EXAMPLE.is_file() else json.dumps(EXAMPLE_REQUEST)
        auth = ' -H "Authorization: Bearer $OPENJEV_API_KEY"' if self.settings.api_key is not None else ""
        return (f"curl -s {url}/v1/systemone{auth} -H 'Content-Type: application/json' "
                f"--data-binary {shlex.quote(body)}")

    def _redis(self) -> str:
        """The Redis URL the children get (with its password, in their environment only)."""
        if self.options.shared_redis:
            if not (urlsplit(self.settings.redis_url).password or self.settings.redis_password):
                raise SystemExit("openjev serve --shared-redis: OPENJEV_REDIS_URL has no password "
                                 "(redis://:PASSWORD@host:port/0) and OPENJEV_REDIS_PASSWORD is unset; "
                                 "a shared Redis must require one")
            _log(f"using the shared Redis: {redis_address(self.settings)}")
            return self.settings.redis_url
        server = RedisServer.on(self.settings.embedded_redis_dir, maxmemory=self.settings.redis_maxmemory)
        try:
            process = server.start()
            self.children.append(Child("redis", [], {}, restart=f"in place: same port, data and password; "
                                                                f"its log: {server.log_path}",
                                       launch=server.start, process=process))
            server.wait_ready()
        except (DataDirInUse, RuntimeError) as exc:
            raise SystemExit(f"openjev serve: {exc}") from None
        _log(f"embedded Redis on {server.address} (append-only file and password in {server.data_dir})")
        return server.url

    def _spawn_api(self, env: dict[str, str]) -> None:
        self._spawn(Child("api", _openjev("api", "--host", self.options.host, "--port", str(self.options.port)),
                          child_env("api", env)), "the HTTP API: loads the tokenizer, 3-10 s on an idle machine")

    def _base_env(self, redis_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env["OPENJEV_REDIS_URL"] = redis_url
        if not self.options.shared_redis:  # the embedded Redis, whatever Sentinels the shell names
            env.pop("OPENJEV_REDIS_SENTINELS", None)
        if not (self.options.connect or self.options.sglang_python):
            env["OPENJEV_TOKENIZER"] = str(self._cpu_model_dir())
            env.setdefault("OPENJEV_SERVED_MODEL_NAME", self._cpu_served_name())
            if self.options.cpu_model:
                from worker.cpu_engine.model import catalog_model

                group_size = catalog_model(self.options.cpu_model).option_group_size
                if group_size:
                    env.setdefault("OPENJEV_OPTION_GROUP_SIZE", str(group_size))
        if self.options.sglang_python:
            from worker.sglang_launcher import context_length

            # The API refuses what this SGLang would: its context is the model's own when that is shorter.
            env["OPENJEV_MAX_INPUT_TOKENS"] = str(context_length(self.settings))
        if self.options.sglang_python and not self.settings.sglang_version:
            from worker.sglang_launcher import installed_sglang_version

            # The workers enable the sgl-project/sglang#34719 workaround from this.
            version = installed_sglang_version(self.options.sglang_python)
            if version:
                env["OPENJEV_SGLANG_VERSION"] = version
        return env

    def _cpu_model_dir(self) -> Path:
        from worker.cpu_engine.model import catalog_dir, default_tokenizer_dir

        models = self.settings.cache_dir / "models"
        return catalog_dir(self.options.cpu_model, models) if self.options.cpu_model else default_tokenizer_dir(models)

    def _cpu_served_name(self) -> str:
        from worker.cpu_engine.model import catalog_model

        return catalog_model(self.options.cpu_model).served_name if self.options.cpu_model else CPU_MODEL_NAME

    def _engines(self, env: dict[str, str]) -> list[str] | None:
        """Start (or point at) the engines; None if one failed to become healthy."""
        if self.options.connect:
            return [self.options.connect.rstrip("/")]
        urls = []
        for i in range(self.options.workers):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self._spawn(Child(f"engine-{i}", *self._engine_command(port, child_env("engine", env)),
                              own_group=bool(self.options.sglang_python)), self._engine_note())
            urls.append(url)
        timeout = SGLANG_START_TIMEOUT if self.options.sglang_python else ENGINE_START_TIMEOUT
        for url, child in zip(urls, self.children[-len(urls):], strict=True):
            if not self._wait_healthy(child, url + "/health", timeout):
                return None
            _log(f"{child.name} ready at {url}")
        return urls

    def _engine_command(self, port: int, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        if self.options.sglang_python:
            from worker.sglang_launcher import sglang_command

            # The launcher's environment carries the frontend switch (SGLANG_RUST_SERVER).
            return sglang_command(self.settings, python=self.options.sglang_python, port=port,
                                  extra_args=self.options.sglang_args, base_env=env)
        model = ["--model", self.options.cpu_model] if self.options.cpu_model else []
        return _openjev("engine", "--port", str(port), "--cache-dir", str(self.settings.cache_dir / "models"),
                        "--compute-delay", str(self.options.compute_delay), *model), env

    def _engine_note(self) -> str:
        if self.options.sglang_python:
            return "SGLang: loads the model and warms up, about 2 min on a CPU, longer the first time"
        if self.options.connect:
            return ""
        name = self.options.cpu_model or "smollm2-135m"
        if self._cpu_model_dir().is_dir():
            return f"the CPU engine: loads {name}, 5-15 s on an idle machine"
        once = "20 s on an idle 2-core machine, 1-2 min on a busy one" if not self.options.cpu_model else "minutes"
        return f"the CPU engine: converts {name} once into {self._cpu_model_dir().parent} ({once}), then loads it"

    def _spawn(self, child: Child, note: str = "") -> None:
        _log(f"starting {child.name}" + (f" ({note})" if note else ""))
        child.start()
        self.children.append(child)

    def _wait_healthy(self, child: Child, url: str, timeout: float) -> bool:
        started = time.monotonic()
        deadline = started + timeout
        next_note = started + PROGRESS_INTERVAL
        # One client for the whole wait: `httpx.get()` would build one, and its SSL context, at every poll.
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline and not self._stopping:
                if self._check_children() is not None:  # any fatal death ends the start, not only this child's
                    return False
                try:
                    if client.get(url).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= next_note:
                    _log(f"still waiting for {child.name} ({time.monotonic() - started:.0f} s)")
                    next_note += PROGRESS_INTERVAL
                time.sleep(0.5)
        if not self._stopping:
            _log(f"{child.name} did not become healthy within {timeout:.0f} s")
        return False

    def _wait_ready(self) -> bool:
        api = next(c for c in self.children if c.name == "api")
        return self._wait_healthy(api, f"http://127.0.0.1:{self.options.port}/health", 180.0)

    def _watch(self) -> int:
        while not self._stopping:
            code = self._check_children()
            if code is not None:
                return code
            time.sleep(0.2)
        return 0

    def _check_children(self) -> int | None:
        """One look at every child: restart a worker or Redis that died (unless the worker's engine
        is down); the exit status to stop with when any other child died, else None."""
        for child in self.children:
            code = child.process.poll() if child.process else None
            if code is None:
                continue
            # A worker whose engine is down cannot be cured by a restart: that stops the group too.
            if child.restart and code != child.gives_up_with and self._may_restart(child):
                _log(f"{child.name} exited with {code}; restarting it ({child.restart})")
                child.start()
                continue
            _log(f"{child.name} exited with {code}; stopping openjev")
            return code or 1
        return None

    def _may_restart(self, child: Child) -> bool:
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < 60] + [now]
        return len(child.restarts) <= RESTART_LIMIT

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stopping = True

    def _stop_all(self) -> None:
        # Everything but Redis at once (each stops within STOP_TIMEOUT or is killed), then Redis: workers
        # store their last outcomes and the API stops taking requests while the queue is still there.
        if self._stopping:
            _log("stopping")
        others = [child for child in self.children if child.name != "redis"]
        redis = [child for child in self.children if child.name == "redis"]
        deadline = time.monotonic() + STOP_TIMEOUT
        for group, until in ((others, deadline), (redis, deadline + REDIS_STOP_TIMEOUT)):
            for child in group:
                child.terminate()
            for child in group:
                child.wait_or_kill(until + (SGLANG_STOP_TIMEOUT - STOP_TIMEOUT if child.own_group else 0.0))

    def _display_host(self) -> str:
        return "127.0.0.1" if self.options.host in ("0.0.0.0", "::") else self.options.host


def child_env(role: str, env: dict[str, str]) -> dict[str, str]:
    """`env` without the secrets a child in `role` (api, worker, engine) does not need; pydantic-settings reads
    names in any case, so they are matched in any case."""
    return {name: value for name, value in env.items()
            if name.upper() not in SECRETS or name.upper() in SECRETS_NEEDED[role]}


def _openjev(*args: str) -> list[str]:
    return [sys.executable, "-m", "openjev", *args]


def _log(message: str) -> None:
    print(f"[openjev serve] {message}", file=sys.stderr, flush=True)
