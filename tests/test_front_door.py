"""The front door of `openjev api`: header size, header and body read timeouts, keep-alive and open
connections are enforced by the server itself, and the key is checked before any body is read.
Raw sockets play the clients that real HTTP libraries would never be."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import time
from collections.abc import Iterator
from contextlib import closing

import pytest

from harness.processes import Proc, start_api
from harness.stacks import Stack
from harness.web import web

LIMITS = {"OPENJEV_MAX_HEADER_BYTES": "4096", "OPENJEV_HEADER_TIMEOUT": "2", "OPENJEV_BODY_TIMEOUT": "3",
          "OPENJEV_KEEP_ALIVE_TIMEOUT": "1", "OPENJEV_MAX_CONNECTIONS": "6"}
REQUEST = json.dumps({"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}}).encode()


@pytest.fixture(scope="module")
def door(scripted_stack: Stack) -> Iterator[Proc]:
    api = start_api(scripted_stack.log_dir, {**scripted_stack.env, **LIMITS})
    yield api
    api.stop()


@pytest.fixture(scope="module")
def keyed(scripted_stack: Stack) -> Iterator[Proc]:
    api = start_api(scripted_stack.log_dir, {**scripted_stack.env, "OPENJEV_API_KEY": "door-key-123"})
    yield api
    api.stop()


def connect(api: Proc) -> socket.socket:
    assert api.url
    host, port = api.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(15)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def trickle(sock: socket.socket, data: bytes, interval: float) -> bytes:
    """Send `data` a byte at a time until the server answers; return its whole answer."""
    sock.settimeout(interval)
    for byte in data:
        sock.sendall(bytes([byte]))
        try:
            first = sock.recv(65536)
        except TimeoutError:
            continue
        return first + read_all(sock)
    return read_all(sock)


def read_response(sock: socket.socket) -> bytes:
    """One response on a kept-alive connection: its head, then Content-Length bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def read_responses(sock: socket.socket, count: int) -> list[bytes]:
    """`count` responses on a kept-alive connection, however the server's writes were cut into reads
    (pipelined answers may come in one)."""
    data, responses = b"", []
    while len(responses) < count:
        if b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            if len(rest) >= length:
                responses.append(head + b"\r\n\r\n" + rest[:length])
                data = rest[length:]
                continue
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the connection after {len(responses)} of {count} answers")
        data += chunk
    return responses


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def test_headers_over_the_limit_are_431_and_the_connection_closed(door: Proc) -> None:
    with closing(connect(door)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 128 * 1024 + b"\r\n\r\n")
        response = read_all(sock)
    assert status_of(response) == 431
    assert b"x-typesafe-request-id: req_" in response
    assert json_body(response)["detail"]["error_type"] == "request_too_large"


def test_thousands_of_small_headers_are_431(door: Proc) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(20000))
    with closing(connect(door)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert status_of(read_all(sock)) == 431


def test_headers_within_the_limit_are_served(door: Proc) -> None:
    r = web.get(door.url + "/health/live", headers={"X-Fine": "a" * 3000}, timeout=10)
    assert r.status_code == 200


def test_a_trickled_header_gets_408_at_the_header_timeout(door: Proc) -> None:
    started = time.monotonic()
    with closing(connect(door)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")
        response = trickle(sock, b"X-Slow: " + b"s" * 30, 0.5)
    assert status_of(response) == 408
    assert json_body(response)["detail"]["error_type"] == "request_timeout"
    assert time.monotonic() - started < 12


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(door: Proc) -> None:
    started = time.monotonic()
    with closing(connect(door)) as sock:
        response = read_all(sock)
    assert status_of(response) == 408
    assert 1.5 < time.monotonic() - started < 12


def test_a_trickled_body_gets_408_at_the_body_timeout(door: Proc) -> None:
    started = time.monotonic()
    with closing(connect(door)) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(REQUEST))
        response = trickle(sock, REQUEST, 0.3)
    assert status_of(response) == 408, response
    assert "did not arrive" in json_body(response)["detail"]["message"]
    assert time.monotonic() - started < 15


def test_keep_alive_serves_several_requests_then_closes_when_idle(door: Proc) -> None:
    request = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with closing(connect(door)) as sock:
        for _ in range(3):
            sock.sendall(request)
            assert status_of(read_response(sock)) == 200
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed by the server once idle past the keep-alive timeout
        assert time.monotonic() - started < 8


def hang_up(sock: socket.socket) -> None:
    """Close our end, then read until the server closes its own: by then it has let go of the connection."""
    with closing(sock), contextlib.suppress(ConnectionResetError):  # a reset: it has let go already
        sock.shutdown(socket.SHUT_WR)
        read_all(sock)


def test_connections_beyond_the_limit_get_503_at_once(door: Proc) -> None:
    # Each connect returns once the handshake is done, and the server accepts connections in that order:
    # the extra one comes after the six held ones.
    held = [connect(door) for _ in range(6)]
    try:
        with closing(connect(door)) as extra:
            response = read_all(extra)
        assert status_of(response) == 503
        assert b"retry-after: 1" in response.lower()
    finally:
        for sock in held:
            hang_up(sock)
    assert web.get(door.url + "/health/live", timeout=10).status_code == 200


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(door: Proc) -> None:
    started = time.monotonic()
    with closing(connect(door)) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300000000\r\n\r\n" + REQUEST[:10])
        response = read_all(sock)
    assert status_of(response) == 413, response
    assert b"x-typesafe-request-id: req_" in response
    assert json_body(response)["detail"]["error_type"] == "request_too_large"
    assert time.monotonic() - started < 2  # the body timeout (3 s) is never waited out


def test_a_client_sending_a_body_over_the_limit_reads_its_413(door: Proc) -> None:
    r = web.post(door.url + "/v1/systemone", content=b"x" * (8 * 1024 * 1024), timeout=30,
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["detail"]["error_type"] == "request_too_large"
    assert web.get(door.url + "/health/live", timeout=10).status_code == 200


# --- requests the front door answers itself -------------------------------------------------------

HEALTH = b"GET /health/live HTTP/1.1\r\nHost: x\r\n"
MALFORMED = {
    "nul_in_a_header": HEALTH + b"X-A: a\x00b\r\n\r\n",
    "content_length_with_transfer_encoding": b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two_content_lengths": b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                           b"Content-Length: 6\r\n\r\nhello",
    "method_foo": b"FOO /health/live HTTP/1.1\r\nHost: x\r\n\r\n",
    "space_in_a_header_name": HEALTH + b"X A: b\r\n\r\n",
    "bare_cr": b"GET /health/live HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
    "negative_content_length": b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "transfer_encoding_gzip": b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    "bad_chunk_size": b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "no_http_version": b"GET /health/live\r\nHost: x\r\n\r\n",
    "http_2_0_as_text": b"GET /health/live HTTP/2.0\r\nHost: x\r\n\r\n",
    "no_host": b"GET /health/live HTTP/1.1\r\n\r\n",
    "two_hosts": HEALTH + b"Host: y\r\n\r\n",
    "header_without_colon": HEALTH + b"NoColon\r\n\r\n",
    "control_char_in_target": b"GET /health/\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
    "obsolete_line_folding": HEALTH + b"X-A: a\r\n folded\r\n\r\n",
    "http2_preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_request_gets_the_contract_error_with_a_request_id(door: Proc, request_bytes: bytes) -> None:
    with closing(connect(door)) as sock:
        sock.sendall(request_bytes)
        response = read_all(sock)
    assert status_of(response) in (400, 505), response
    assert b"content-type: application/json" in response
    assert b"x-typesafe-request-id: req_" in response
    assert json_body(response)["detail"]["error_type"] == "invalid_request_error"
    assert web.get(door.url + "/health/live", timeout=10).status_code == 200


def test_connect_gets_405_with_the_contract_error(door: Proc) -> None:
    with closing(connect(door)) as sock:
        sock.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        response = read_all(sock)
    assert status_of(response) == 405, response
    assert b"x-typesafe-request-id: req_" in response
    assert json_body(response)["detail"]["error_type"] == "method_not_allowed"


UPGRADES = pytest.mark.parametrize("upgrade", [
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
    b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n"], ids=["h2c", "websocket"])  # protocol switch proposals, turned down


@UPGRADES
def test_an_upgrade_is_ignored_and_answered_over_http_1_1_on_a_kept_connection(door: Proc, upgrade: bytes) -> None:
    with closing(connect(door)) as sock:
        sock.sendall(HEALTH + upgrade + b"\r\n")
        first = read_response(sock)
        sock.sendall(HEALTH + b"\r\n")  # the same connection serves the next request
        second = read_response(sock)
    for response in (first, second):
        assert response.startswith(b"HTTP/1.1 200"), response
        assert b"x-typesafe-request-id: req_" in response


@UPGRADES
def test_a_request_sent_right_behind_an_upgrade_in_one_packet_is_answered_too(door: Proc, upgrade: bytes) -> None:
    with closing(connect(door)) as sock:
        sock.sendall(HEALTH + upgrade + b"\r\n" + HEALTH + b"\r\n")
        answers = read_responses(sock, 2)
    assert [status_of(a) for a in answers] == [200, 200], answers


# --- the key before the body ---------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "status"), [({}, 403), ({"Authorization": "Bearer wrong"}, 401)])
def test_the_key_is_checked_before_the_body_is_read(keyed: Proc, headers: dict, status: int) -> None:
    url = keyed.url + "/v1/systemone"
    for content, extra in [(b'{"model": "jev-latest", "state": "x", "q', {}),
                           (b"x" * (3 * 1024 * 1024), {}),
                           (gzip.compress(REQUEST)[:-5], {"Content-Encoding": "gzip"}),
                           (REQUEST, {"Content-Encoding": "brotli"})]:
        r = web.post(url, content=content, timeout=30,
                     headers={"Content-Type": "application/json", **headers, **extra})
        assert r.status_code == status, (r.status_code, r.text)
        assert r.json()["detail"]["error_type"] == "authentication_error"


def test_a_413_is_read_whole_though_the_client_goes_on_sending_its_body(door: Proc) -> None:
    """The body gate answers 413 to a declared length over the limit before reading a byte, and uvicorn then
    closes the connection while the client is still sending the body it declared, as clients do. A plain
    close with those bytes unread answers them with a reset: the client's send fails, and its read of the
    answer with it. The front door's close lingers instead, reading and dropping them, so the client sends
    what it sends and reads the answer, then the end of the connection."""
    with closing(connect(door)) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300000000\r\n\r\n")
        for _ in range(64):  # 4 MB of the body, sent on after the answer
            sock.sendall(b"x" * 65536)
        response = read_all(sock)  # a reset raises ConnectionResetError (or BrokenPipeError above)
    assert status_of(response) == 413, response
    assert json_body(response)["detail"]["error_type"] == "request_too_large"


def test_with_the_key_the_same_bad_bodies_get_their_own_4xx(keyed: Proc) -> None:
    auth = {"Authorization": "Bearer door-key-123", "Content-Type": "application/json"}
    url = keyed.url + "/v1/systemone"
    assert web.post(url, content=b'{"model": "x', headers=auth, timeout=30).status_code == 422
    truncated = gzip.compress(REQUEST)[:-5]
    r = web.post(url, content=truncated, headers={**auth, "Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 400
    assert web.post(url, content=REQUEST, headers=auth, timeout=30).status_code == 200


# --- pipelining ---------------------------------------------------------------------------------------


def test_pipelined_requests_are_answered_whole_and_in_order(door: Proc) -> None:
    """Three requests in one packet, the middle one refused by the app (malformed JSON): three whole
    answers, in order, on the one connection."""
    bad = b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1\r\n\r\n{"
    with closing(connect(door)) as sock:
        sock.sendall(HEALTH + b"\r\n" + bad + HEALTH + b"\r\n")
        answers = read_responses(sock, 3)
    assert [status_of(a) for a in answers] == [200, 422, 200], answers
    assert all(a.count(b"HTTP/1.1 ") == 1 for a in answers)
