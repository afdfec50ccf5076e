"""The API's HTTP server (api/server.py): uvicorn's Server without its 10 Hz tick. At rest the process
sleeps until a request or a signal; responses still carry a current Date; SIGTERM and SIGINT still shut
it down gracefully."""

from __future__ import annotations

import signal
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import pytest

from harness.processes import Proc, start_api
from harness.procfs import wakeups
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, stack_env
from harness.web import web
from tests.conftest import wait_until
from tests.test_logs import events

AT_REST_SECONDS = 3.0
ESTABLISHED, CLOSE_WAIT = "01", "08"  # TCP states as /proc/net/tcp writes them


def request_logged(api: Proc, request_id: str) -> bool:
    return any(e.get("event") == "request" and e.get("request_id") == request_id for e in events(api.output()))


def held_connections(port: int) -> int:
    """TCP connections the server on `port` still holds open (established, or closed by the client only)."""
    rows = [line.split() for table in ("/proc/net/tcp", "/proc/net/tcp6")
            for line in Path(table).read_text().splitlines()[1:]]
    return sum(1 for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] in (ESTABLISHED, CLOSE_WAIT))


def test_the_api_process_sleeps_at_rest(scripted_stack: Stack) -> None:
    """uvicorn's own main loop wakes ten times a second (30 in this window); ours only for work."""
    response = scripted_stack.post({"model": "jev-latest", "state": "hi", "questions": {
        "q": {"type": "noul", "instructions": "Is this a greeting?"}}})
    assert response.status_code == 200
    pid = scripted_stack.api.process.pid
    request_id, port = response.headers["x-typesafe-request-id"], int(scripted_stack.url.rsplit(":", 1)[1])
    # past the request's own wake-ups: its log line is written and its connection closed on the server's side
    wait_until(lambda: request_logged(scripted_stack.api, request_id) and not held_connections(port), 10,
               "the request logged and its connection let go")
    before = wakeups(pid)
    time.sleep(AT_REST_SECONDS)
    woken = wakeups(pid) - before
    assert woken <= AT_REST_SECONDS * 2, f"the API woke {woken} times in {AT_REST_SECONDS} s at rest"


def test_every_response_carries_one_current_date(scripted_stack: Stack) -> None:
    """The Date is the app's, formatted when a response asks for it (nothing refreshes it at rest)."""
    dates = []
    for path in ("/health/live", "/v1/nothing-here", "/health/live"):
        response = web.get(f"{scripted_stack.api.url}{path}", timeout=10)
        assert len(response.headers.get_list("date")) == 1, response.headers
        assert "server" not in response.headers
        sent = parsedate_to_datetime(response.headers["date"]).timestamp()
        assert abs(sent - time.time()) < 2.5
        dates.append(sent)
        time.sleep(1.1)  # time passing is what is tested: the next Date (whole seconds) must be a later one
    assert dates[0] < dates[1] < dates[2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_api_gracefully(signum: int, model_dir: Path, log_dir: Path) -> None:
    with fresh_redis() as redis_url:
        api: Proc = start_api(log_dir, stack_env(redis_url, model_dir), wait_ready=False)
        try:
            assert web.get(f"{api.url}/health/live", timeout=10).status_code == 200
            started = time.monotonic()
            assert api.stop(signum, timeout=15) == 0, api.output()[-4000:]
            assert time.monotonic() - started < 10
        finally:
            api.kill()
