"""Async jobs: submit, long-poll, cancel, idempotent retries; same validation as the sync route."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from redis import Redis

from common.jobs import JobIds
from common.queue import keys
from common.settings import Settings
from harness.stacks import Stack
from harness.web import web
from tests.conftest import wait_until
from tests.test_api_contract import INVALID, NOUL, SCORE, body
from tests.test_logs import events


@pytest.fixture(autouse=True)
def _reset_script(scripted_stack: Stack):
    scripted_stack.script(delay=0.0, fail_rid_suffix=None, fail_delay=0.0, report_cached=True)
    yield


def submit(stack: Stack, payload: dict, **headers: str) -> httpx.Response:
    return web.post(stack.url + "/v1/jobs", json=payload, headers=headers, timeout=30)


def test_submit_answers_202_with_an_unguessable_id_and_location(scripted_stack: Stack) -> None:
    r = submit(scripted_stack, body())
    assert r.status_code == 202, r.text
    job = r.json()
    finished = {"result"} if job["status"] == "succeeded" else set()  # a fast engine may be done already
    assert set(job) == {"id", "status", "created_at", "deadline_at"} | finished
    assert re.fullmatch(r"job_[0-9a-f]{60}", job["id"])
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] in ("queued", "running", "succeeded")


def test_waiting_get_returns_exactly_the_sync_body(scripted_stack: Stack) -> None:
    payload = body({"a": NOUL, "b": SCORE})
    job = submit(scripted_stack, payload).json()
    got = web.get(f"{scripted_stack.url}/v1/jobs/{job['id']}", params={"wait": 10}, timeout=30).json()
    assert got["status"] == "succeeded"
    sync = scripted_stack.post(payload).json()
    assert got["result"] == sync  # same state, same questions: the same answers and usage, byte for byte in JSON
    assert "error" not in got


def test_wait_is_bounded_and_returns_the_pending_status(scripted_stack: Stack) -> None:
    scripted_stack.script(delay=3.0)
    job = submit(scripted_stack, body()).json()
    started = time.monotonic()
    got = web.get(f"{scripted_stack.url}/v1/jobs/{job['id']}", params={"wait": 1}, timeout=30).json()
    assert 0.9 <= time.monotonic() - started < 2.5
    assert got["status"] in ("queued", "running")
    too_long = web.get(f"{scripted_stack.url}/v1/jobs/{job['id']}", params={"wait": 31}, timeout=30)
    assert too_long.status_code == 422


def test_delete_cancels_a_running_job_and_aborts_its_calls_in_the_engine(scripted_stack: Stack) -> None:
    scripted_stack.script(delay=5.0)
    before = scripted_stack.engine_stats()
    job = submit(scripted_stack, body({"a": NOUL, "b": NOUL})).json()
    url = f"{scripted_stack.url}/v1/jobs/{job['id']}"
    wait_until(lambda: [r for r in scripted_stack.engine_stats()["live"] if r.startswith(job["id"])], 10,
               "the job's warm call live in the engine")
    cancelled = web.delete(url, timeout=30).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["error"]["error_type"] == "cancelled"

    def aborted() -> dict | None:
        stats = scripted_stack.engine_stats()
        live = [rid for rid in stats["live"] if rid.startswith(job["id"])]
        return stats if stats["requests_aborted"] > before["requests_aborted"] and not live else None

    after = wait_until(aborted, 10, "the job's engine calls aborted")
    assert after["aborts_received"] > before["aborts_received"]
    assert after["requests_aborted"] > before["requests_aborted"]
    assert [rid for rid in after["received"] if rid.startswith(job["id"])]  # it did reach the engine
    assert not [rid for rid in after["finished"] if rid.startswith(job["id"])]  # and nothing of it ran to the end
    assert web.get(url).json()["status"] == "cancelled"


def test_idempotency_key_returns_the_same_job_for_a_retried_submission(scripted_stack: Stack) -> None:
    key = f"retry-{time.monotonic_ns()}"
    first = submit(scripted_stack, body(), **{"Idempotency-Key": key})
    second = submit(scripted_stack, body(), **{"Idempotency-Key": key})
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    other = submit(scripted_stack, body({"z": SCORE}), **{"Idempotency-Key": key})
    assert other.status_code == 409
    assert other.json()["detail"]["error_type"] == "idempotency_error"


def test_unknown_job_is_404_in_the_error_shape(scripted_stack: Stack) -> None:
    r = web.get(f"{scripted_stack.url}/v1/jobs/job_{'0' * 32}")
    assert r.status_code == 404
    assert r.json()["detail"]["error_type"] == "not_found_error"


def test_a_sync_request_whose_job_the_queue_loses_is_told_to_send_it_again(scripted_stack: Stack) -> None:
    """A Redis that comes back without a waiting sync request's job: a 503 with Retry-After that
    says so, at the next record check (1 s), never a 504 at the deadline."""
    scripted_stack.script(delay=5.0)
    client = Redis.from_url(scripted_stack.redis_url)

    def ours(key: bytes) -> bool:  # this test's job: sync, not ended, created by it (Redis may be shared)
        kind, status, created = client.hmget(key, "kind", "status", "created_at")
        return kind == b"sync" and status in (b"queued", b"running") and float(created or 0) >= sent - 1

    sent = time.time()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, scripted_stack.url + "/v1/systemone",
                             json=body({"q": NOUL}, state=f"lost {time.monotonic_ns()}"), timeout=30)
        deadline = time.monotonic() + 10
        while not (waiting := [key for key in client.scan_iter(keys.job_key("*")) if ours(key)]):
            assert time.monotonic() < deadline, "the sync job was never placed"
            time.sleep(0.02)
        started = time.monotonic()
        client.delete(*waiting)  # what a Redis that lost its data leaves
        response = answer.result()
    client.close()
    assert time.monotonic() - started < 3.0  # well before the engine's 5 s, and the request's deadline
    assert response.status_code == 503, response.text
    assert response.json()["detail"]["error_type"] == "unavailable_error"
    assert "send the request again" in response.json()["detail"]["message"]
    assert int(response.headers["retry-after"]) >= 1
    # The worker still evaluates the job Redis lost if it had started it (nothing cancelled it), and then
    # finds no record to store into; if the record went first, it skips the placement. Wait for either, so
    # none of its engine calls lands in a later test's counts.
    (lost,) = [key.decode().removeprefix(keys.job_key("")) for key in waiting]
    wait_until(lambda: any(e.get("event") in ("job", "placement_skipped") and e.get("job_id") == lost
                           for worker in scripted_stack.workers for e in events(worker.output())),
               30, "the lost job's ending on its worker")


def test_a_lost_job_says_so_apart_from_an_unknown_or_expired_one(scripted_stack: Stack) -> None:
    job = submit(scripted_stack, body()).json()
    done = web.get(f"{scripted_stack.url}/v1/jobs/{job['id']}", params={"wait": 10}, timeout=30).json()
    assert done["status"] == "succeeded"
    client = Redis.from_url(scripted_stack.redis_url)
    client.delete(keys.job_key(job["id"]))  # what a Redis that lost its data (no persistence, a wiped disk) leaves
    client.close()
    lost = web.get(f"{scripted_stack.url}/v1/jobs/{job['id']}", timeout=10)
    assert lost.status_code == 410
    assert lost.json()["detail"]["error_type"] == "job_lost_error"
    assert "submit the request again" in lost.json()["detail"]["message"]
    assert web.delete(f"{scripted_stack.url}/v1/jobs/{job['id']}", timeout=10).status_code == 410

    settings = Settings(_env_file=None, redis_url=scripted_stack.redis_url)  # type: ignore[call-arg]  # the stack's
    issued = JobIds(settings.job_id_key)  # the stack's own ids: its key derives from the Redis URL it shares
    ttl = settings.job_result_ttl
    expired = issued.new(time.time() - ttl - 60)  # older than any record is kept: it expired, or never was
    for job_id in (expired, f"job_{'0' * 32}", "job_not-an-id"):
        gone = web.get(f"{scripted_stack.url}/v1/jobs/{job_id}", timeout=10)
        assert gone.status_code == 404, job_id
        assert gone.json()["detail"]["error_type"] == "not_found_error"
    lost_too = web.get(f"{scripted_stack.url}/v1/jobs/{issued.new(time.time())}", timeout=10)
    assert lost_too.status_code == 410  # issued by this server (its tag), younger than the TTL, no record


def test_a_job_id_the_server_never_issued_is_unknown_not_lost(scripted_stack: Stack) -> None:
    now_ms = f"{int(time.time() * 1000):012x}"
    forged = JobIds(b"not the server's key").new(time.time())
    for job_id in (f"job_{now_ms}{'0' * 32}", f"job_{now_ms}{'0' * 48}", forged):
        unknown = web.get(f"{scripted_stack.url}/v1/jobs/{job_id}", timeout=10)
        assert unknown.status_code == 404, (job_id, unknown.text)
        assert unknown.json()["detail"]["error_type"] == "not_found_error"
        assert web.delete(f"{scripted_stack.url}/v1/jobs/{job_id}", timeout=10).status_code == 404


def test_a_job_id_carries_its_creation_time_128_random_bits_and_its_servers_tag() -> None:
    now = time.time()
    ids = JobIds(b"key one")
    issued = {ids.new(now) for _ in range(100)}
    assert len(issued) == 100
    assert {round(ids.created_at(job_id) or 0, 3) for job_id in issued} == {round(int(now * 1000) / 1000, 3)}
    assert ids.created_at(f"job_{'0' * 32}") is None and ids.created_at("job_x") is None
    assert all(JobIds(b"key two").created_at(job_id) is None for job_id in issued)
    one = next(iter(issued))
    flipped = one[:-1] + ("0" if one[-1] != "0" else "1")
    assert ids.created_at(flipped) is None
    assert Settings(redis_url="redis://:a@h:1/0").job_id_key != Settings(redis_url="redis://:b@h:1/0").job_id_key
    assert Settings(job_id_secret="s", redis_url="redis://:a@h:1/0").job_id_key == b"s"


@pytest.mark.parametrize("case", ["missing-state", "type-boolean", "too-many-options", "over-token-budget"])
def test_invalid_submissions_get_the_same_4xx_before_anything_is_queued(scripted_stack: Stack, case: str) -> None:
    before = scripted_stack.engine_stats()["requests_received"]
    sync = scripted_stack.post(INVALID[case])
    job = submit(scripted_stack, INVALID[case])
    assert job.status_code == sync.status_code == 422
    assert job.json()["detail"][0]["loc"] == sync.json()["detail"][0]["loc"]
    assert scripted_stack.engine_stats()["requests_received"] == before


def test_jobs_routes_are_documented_in_the_openapi_schema(scripted_stack: Stack) -> None:
    paths = web.get(scripted_stack.url + "/openapi.json").json()["paths"]
    assert {"post"} <= set(paths["/v1/jobs"]) and {"get", "delete"} <= set(paths["/v1/jobs/{job_id}"])
