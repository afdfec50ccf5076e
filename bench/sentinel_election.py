"""How long a failover takes when its first election does not finish, against Sentinel's
`failover-timeout`. The tests' Sentinel group (one master, one replica, three Sentinels on loopback,
`down-after-milliseconds 1000`): the master is killed with -9, and in the stalled form the first
Sentinel to try a failover is stopped (SIGSTOP) once it has asked for votes and stays stopped, as a
leader that stalled or died would. The Sentinels that voted for it try no failover of their own for
twice the failover timeout, so the promotion's time follows that setting. Timed from the kill until
the replica reports itself master and the Sentinels name it.

    uv run --extra cpu --extra dev python -m bench.sentinel_election [--rounds 3] [--timeouts 3000,10000]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

import redis

from harness.sentinels import SentinelGroup


def one_failover(failover_timeout_ms: int, stall: bool) -> float:
    """Seconds from the master's kill to the replica's promotion, as the Sentinels report it."""
    with tempfile.TemporaryDirectory() as root:
        group = SentinelGroup(Path(root), failover_timeout_ms=failover_timeout_ms)
        try:
            group.wait_ready()
            group.master.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            group.master.wait(10)
            candidate = _first_candidate(group, killed + 30) if stall else None
            if candidate is not None:
                group.sentinel_processes[candidate].send_signal(signal.SIGSTOP)
            asked = 1 if candidate == 0 else 0  # a Sentinel that answers
            try:
                while not _promoted(group, asked):
                    if time.monotonic() - killed > 120:
                        raise AssertionError(f"no promotion in 120 s\n{group.events()}")
                    time.sleep(0.02)
                return time.monotonic() - killed
            finally:
                if candidate is not None:
                    group.sentinel_processes[candidate].send_signal(signal.SIGCONT)
        finally:
            group.stop()


def _first_candidate(group: SentinelGroup, deadline: float) -> int:
    """The index of the first Sentinel to try a failover."""
    while time.monotonic() < deadline:
        for index in range(len(group.sentinel_processes)):
            if "+try-failover" in group.log(index):
                return index
        time.sleep(0.002)
    raise AssertionError(f"no Sentinel tried a failover\n{group.events()}")


def _promoted(group: SentinelGroup, sentinel: int) -> bool:
    try:
        return (group.client(group.replica_port).info("replication")["role"] == "master"
                and group.current_master(sentinel) == group.replica_port)
    except (redis.ConnectionError, redis.TimeoutError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeouts", default="3000,10000", help="failover-timeout values (ms), comma-separated")
    args = parser.parse_args()
    print("| failover-timeout | first election | seconds to promotion (each round) | median |")
    print("|---|---|---|---|")
    for timeout_ms in (int(value) for value in args.timeouts.split(",")):
        for stall in (False, True):
            took = [one_failover(timeout_ms, stall) for _ in range(args.rounds)]
            form = "its candidate stopped" if stall else "finishes"
            print(f"| {timeout_ms} ms | {form} | {', '.join(f'{t:.2f}' for t in took)} | "
                  f"{statistics.median(took):.2f} |", flush=True)


if __name__ == "__main__":
    main()
