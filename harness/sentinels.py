"""A Sentinel-managed Redis on loopback for the tests and bench/replica_wait.py: one master, one replica
and three Sentinels, real redis-server processes (the binary in Sentinel mode), one password."""

from __future__ import annotations

import secrets
import subprocess
import time
from datetime import datetime
from pathlib import Path

import redis

from common.settings import Settings
from openjev.embedded_redis import PERSISTENCE_ARGS, find_redis_server, free_port

MASTER_NAME = "openjev"
DOWN_AFTER_MS = 1000  # a Sentinel calls the master down after this long without an answer
# A Sentinel that voted in a failover's election tries none of its own for twice this, so an election that
# splits (three Sentinels that see the master down within a few milliseconds may each vote for itself) is
# tried again 6 s later, inside the 10 s a failover has (at 10000 ms it was 20 s: CI once saw a failover
# take over 15 s). It also bounds the wait for the replica to report its promotion (under a second here).
FAILOVER_TIMEOUT_MS = 3000


class SentinelGroup:
    """A master, a replica of it and three Sentinels on loopback, all with one password."""

    def __init__(self, root: Path, failover_timeout_ms: int = FAILOVER_TIMEOUT_MS) -> None:
        self.root = root
        self.failover_timeout_ms = failover_timeout_ms
        self.password = secrets.token_hex(16)
        self.binary = str(find_redis_server())
        self.processes: list[subprocess.Popen[bytes]] = []
        self.master_port, self.replica_port = free_port(), free_port()
        self.master = self._redis("master", self.master_port, [])
        self.replica = self._redis("replica", self.replica_port, [f"replicaof 127.0.0.1 {self.master_port}"])
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinel_processes: list[subprocess.Popen[bytes]] = []
        for i, port in enumerate(self.sentinel_ports):
            self.sentinel_processes.append(self._sentinel(i, port))

    def _redis(self, name: str, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
        data = self.root / name
        data.mkdir(mode=0o700)
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), *PERSISTENCE_ARGS,
                "--logfile", str(data / "redis.log"), "-"]
        config = [f"requirepass {self.password}", f"masterauth {self.password}", *extra]
        return self._start(argv, "\n".join(config))

    def _sentinel(self, index: int, port: int) -> subprocess.Popen[bytes]:
        data = self.root / f"sentinel-{index}"
        data.mkdir(mode=0o700)
        config = data / "sentinel.conf"  # a Sentinel rewrites its file: it must be its own and writable
        config.write_text("\n".join([
            f"port {port}", "bind 127.0.0.1", f"dir {data}", f"logfile {data / 'sentinel.log'}",
            f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}",
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2",
            f"sentinel auth-pass {MASTER_NAME} {self.password}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}", ""]))
        config.chmod(0o600)
        return self._start([self.binary, str(config), "--sentinel"], "")

    def _start(self, argv: list[str], stdin: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert process.stdin is not None
        process.stdin.write(stdin.encode())
        process.stdin.close()
        self.processes.append(process)
        return process

    @property
    def sentinels(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def env(self) -> dict[str, str]:
        """The settings every process gets: the URL names the first master but carries no password
        (it comes apart, as from a Kubernetes Secret); a process that ignored the Sentinels would keep
        talking to the dead master."""
        return {"OPENJEV_REDIS_URL": f"redis://127.0.0.1:{self.master_port}/0",
                "OPENJEV_REDIS_PASSWORD": self.password,
                "OPENJEV_REDIS_SENTINELS": self.sentinels, "OPENJEV_REDIS_SENTINEL_MASTER": MASTER_NAME}

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.password, socket_timeout=2, socket_connect_timeout=1)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and every Sentinel knows the replica and the other two."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready():
                return
            time.sleep(0.05)
        raise AssertionError(f"the Sentinel group did not settle in {timeout} s; logs in {self.root}")

    def _ready(self) -> bool:
        try:
            if self.client(self.replica_port).info("replication").get("master_link_status") != "up":
                return False
            for port in self.sentinel_ports:
                master = self.client(port).sentinel_masters().get(MASTER_NAME, {})
                if master.get("num-other-sentinels") != 2 or master.get("num-slaves") != 1:
                    return False
        except (redis.ConnectionError, redis.TimeoutError, ValueError):
            return False
        return True

    def log(self, index: int) -> str:
        """Sentinel `index`'s log so far."""
        path = self.root / f"sentinel-{index}" / "sentinel.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, last: int = 25) -> str:
        """Each Sentinel's last `last` events (the log's "+event" and "-event" lines: votes, elections,
        aborts, delays), for a failure's message."""
        parts = []
        for i in range(len(self.sentinel_ports)):
            events = [line for line in self.log(i).splitlines() if " # " in line or " * " in line][-last:]
            parts.append(f"sentinel {i}:\n" + "\n".join(events))
        return "\n".join(parts)

    def switched_at(self) -> float | None:
        """When a Sentinel first named a new master (its log's "+switch-master" line), in epoch seconds; None
        before any did. Redis stamps its log lines with the local time, to the millisecond."""
        stamps = [line.split(" ", 1)[1].split(" # ")[0] for i in range(len(self.sentinel_ports))
                  for line in self.log(i).splitlines() if "+switch-master" in line]
        return min((datetime.strptime(stamp, "%d %b %Y %H:%M:%S.%f").timestamp() for stamp in stamps), default=None)

    def current_master(self, sentinel: int = 0) -> int:
        """The master's port, as Sentinel `sentinel` names it."""
        _, port = self.client(self.sentinel_ports[sentinel]).sentinel_get_master_addr_by_name(MASTER_NAME)
        return int(port)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()



def settings_for(group: SentinelGroup) -> Settings:
    return Settings(_env_file=None, **{  # type: ignore[call-arg]
        name.removeprefix("OPENJEV_").lower(): value for name, value in group.env().items()})


