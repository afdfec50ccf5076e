"""The harness's look at /proc (harness/procfs.py) that tells a test's own server from another test's: a
process counts as listening on a port only while it, or a process it started, holds that listening socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from harness.procfs import descendants, listens_on


def test_a_port_is_a_processs_own_only_while_it_or_its_child_listens_there() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            assert listens_on(os.getpid(), port)  # this process holds it
            assert not listens_on(other.pid, port)  # another process does not
            assert other.pid in descendants(os.getpid())
        assert not listens_on(os.getpid(), port)  # closed: nobody listens
    finally:
        other.kill()
        other.wait()
