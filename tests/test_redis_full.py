"""A Redis at its maxmemory (noeviction, as every deployment runs it): the API refuses new jobs at once with
a 503 that says the queue is full, the worker rides it out (arq's own transactions are refused too, and an
error there used to end the worker), and what was accepted before runs to its answer once memory is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.queue import keys
from harness.stacks import Stack, answered, final_statuses, isolated_scripted_stack
from harness.web import web
from tests.conftest import wait_until
from tests.test_api_contract import NOUL, body
from tests.test_logs import events
from tests.test_metrics import samples

pytestmark = pytest.mark.integration


def request(i: int) -> dict:
    """A job of about 12 kB in Redis: a few hundred of them fill the tests' small maxmemory."""
    return body({"q": NOUL}, state=f"Ticket {i}: refund? " + "The order arrived damaged. " * 60)


@pytest.fixture
def stack(model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    with isolated_scripted_stack(model_dir, log_dir) as running:  # its own Redis: CONFIG SET is server-wide
        yield running


def refused_transactions(client: redis.Redis) -> int:
    """MULTI/EXEC transactions Redis has refused whole (EXECABORT): arq's poll reads cancellations in one."""
    return int(client.info("errorstats").get("errorstat_EXECABORT", {}).get("count", 0))


def test_a_full_redis_refuses_new_jobs_with_a_503_and_the_worker_rides_it_out(stack: Stack) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        stack.script(delay=2.0)
        accepted = web.post(stack.url + "/v1/jobs", json=body({"a": NOUL}, state="accepted before"), timeout=30)
        assert accepted.status_code == 202, accepted.text
        wait_until(lambda: stack.engine_stats()["live"], 15, "the accepted job at its engine")
        refused_before = refused_transactions(client)
        client.config_set("maxmemory", 1)  # every write that needs memory is refused
        full_at = time.monotonic()
        try:
            for path in ("/v1/systemone", "/v1/jobs"):
                started = time.monotonic()
                response = web.post(stack.url + path, json=body({"a": NOUL}, state=f"while full {path}"), timeout=30)
                assert response.status_code == 503, (path, response.text)
                assert "maxmemory" in response.json()["detail"]["message"], response.text
                assert int(response.headers["retry-after"]) >= 1
                assert time.monotonic() - started < 5, path  # refused at the door, not left to its deadline
            # arq's poll is refused twice over: the worker met the refusal and went on
            wait_until(lambda: refused_transactions(client) >= refused_before + 2, 30, "arq's poll refused twice")
            assert stack.workers[0].alive(), stack.workers[0].output()[-3000:]
        finally:
            client.config_set("maxmemory", 0)
            full_for = time.monotonic() - full_at
        stack.script(delay=0.0)
        assert final_statuses(stack.url, [accepted.json()["id"]], 60) == ["succeeded"]
        after = answered(stack.url, body({"a": NOUL}, state="after"), 30)  # 503 "no worker" until its next beat
        assert after.status_code == 200, after.text
        assert after.json()["answers"]["a"]["type"] == "noul"
        assert stack.workers[0].alive()
        # A beat a second was refused (Redis 6 refuses a script's write inside it; Redis 7 refuses the script,
        # which the client retries): a warning at the first refusal, then one every 10 s, not one a beat.
        warned = [e["message"] for e in events(stack.workers[0].output())
                  if e.get("level") == "warning" and e["message"].startswith("heartbeat failed")]
        assert len(warned) <= 2 + full_for // 10, (full_for, warned)
        assert "Traceback" not in stack.workers[0].output()
    finally:
        client.close()


def test_a_redis_filled_with_queued_jobs_runs_every_one_of_them_with_its_limit_kept(
        model_dir: Path, log_dir: Path) -> None:
    """Jobs queued until the API says the queue is full: a sync request still gets its answer (it may use half
    the headroom), the jobs it took all start and end while the limit stays (the API stops short of it by
    OPENJEV_REDIS_HEADROOM, so a job's start and end have room), Redis refuses no write, and once they have
    ended the queue takes new jobs again. Without the headroom Redis refuses arq's start of every queued job
    (its count of tries) until keys expire: none would run.

    The headroom holds the clients' buffers too (about 20 kB a connection, and the waits below open ~16
    more): on this tiny maxmemory that takes 0.4 of it, where 0.1 of a production Redis's does."""
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_REDIS_HEADROOM="0.4") as stack:
        client = redis.Redis.from_url(stack.redis_url)
        try:
            stack.script(delay=0.3)  # the worker's slots stay busy: the jobs pile up in its queue

            first = web.post(stack.url + "/v1/jobs", json=request(0), timeout=30)  # Redis's first job: ~0.2 MB
            assert first.status_code == 202, first.text
            job_ids = [first.json()["id"]]
            client.config_set("maxmemory", client.info("memory")["used_memory"] + 2_000_000)
            refused = None
            for i in range(1, 2000):
                response = web.post(stack.url + "/v1/jobs", json=request(i), timeout=30)
                if response.status_code != 202:
                    refused = response
                    break
                job_ids.append(response.json()["id"])
            assert refused is not None and refused.status_code == 503, refused and refused.text
            assert "the job queue is full" in refused.json()["detail"]["message"], refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert len(job_ids) >= 20, len(job_ids)
            # A sync request still gets in: it may use half the headroom (its caller waits; no backlog builds)
            sync = web.post(stack.url + "/v1/systemone", json=request(-1), timeout=30)
            assert sync.status_code == 200, sync.text

            stack.script(delay=0.0)
            assert final_statuses(stack.url, job_ids, 60) == ["succeeded"] * len(job_ids)
            assert client.config_get("maxmemory")["maxmemory"] != "0"  # nothing lifted it
            assert int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0)) == 0  # none refused
            after = answered(stack.url, request(len(job_ids)), 30, path="/v1/jobs")
            assert after.status_code == 202, after.text
            assert final_statuses(stack.url, [after.json()["id"]], 30) == ["succeeded"]
            assert stack.workers[0].alive() and "Traceback" not in stack.workers[0].output()
            print(f"\n{len(job_ids)} jobs queued until full, all succeeded with the limit kept")
        finally:
            client.config_set("maxmemory", 0)
            client.close()


ALPHA_KEY, BETA_KEY = "alpha-key-0123456789", "beta-key-0123456789"


def in_the_band(client: redis.Redis) -> None:
    """Redis's maxmemory set so that what it holds now is 0.7 of it: inside the band of a 0.2 headroom (0.6 to
    0.8), with room either way for what the next few placements and endings move."""
    client.config_set("maxmemory", int(client.info("memory")["used_memory"] / 0.7))


def tenants_file(tmp_path: Path) -> Path:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[tenants.alpha]\nkey = "{ALPHA_KEY}"\noperator = true\n\n'
                         f'[tenants.beta]\nkey = "{BETA_KEY}"\n')
    return keys_file


def test_near_its_maxmemory_a_tenant_whose_kept_results_fill_redis_is_held_though_its_queue_is_empty(
        model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    """A tenant sends async jobs one at a time and reads each result before the next: its queue is empty at
    every placement, and what fills Redis is its results, kept for their readers (OPENJEV_JOB_RESULT_TTL).
    Past twice the headroom below maxmemory it gets 429 all the same, since its share of Redis counts its kept
    jobs, and the other tenant's async jobs still get in. Counting queued jobs alone, it went on to the
    headroom, where everyone's async jobs got 503 "the job queue is full"."""
    alpha, beta = {"Authorization": f"Bearer {ALPHA_KEY}"}, {"Authorization": f"Bearer {BETA_KEY}"}
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_REDIS_HEADROOM="0.2",
                                 OPENJEV_API_KEYS_FILE=str(tenants_file(tmp_path))) as stack:
        client = redis.Redis.from_url(stack.redis_url)
        try:
            def submit(i: int, headers: dict[str, str]) -> httpx.Response:
                return web.post(stack.url + "/v1/jobs", json=body({"q": NOUL}, state=f"Ticket {i}"), headers=headers,
                                timeout=30)

            def ended(response: httpx.Response, headers: dict[str, str]) -> str:
                job_id = response.json()["id"]
                return final_statuses(stack.url, [job_id], 30, headers)[0]

            first = submit(0, alpha)
            assert first.status_code == 202 and ended(first, alpha) == "succeeded", first.text
            # The band (maxmemory less twice the headroom: 0.6 of it) starts 200 kB above what Redis holds now.
            client.config_set("maxmemory", int((client.info("memory")["used_memory"] + 200_000) / 0.6))
            refused, kept = None, 1
            for i in range(1, 3000):
                response = submit(i, alpha)
                if response.status_code != 202:
                    refused = response
                    break
                assert ended(response, alpha) == "succeeded"
                kept += 1
            assert refused is not None and refused.status_code == 429, refused and refused.text
            assert "(queued, or ended and kept for their readers)" in refused.json()["detail"]["message"]
            assert kept >= 10, kept  # its results did fill Redis up to the band
            memory = client.info("memory")
            assert memory["used_memory"] < memory["maxmemory"] * 0.8  # short of the headroom: room left
            assert client.zcard(keys.tenant_key("alpha", "kept")) == kept
            assert client.zcard(keys.tenant_key("alpha", "async")) == 0

            for i in range(3):  # the other tenant's async jobs still get in
                response = submit(10_000 + i, beta)
                assert response.status_code == 202, response.text
                assert ended(response, beta) == "succeeded"
            assert submit(20_000, alpha).status_code == 429
            assert int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0)) == 0
            print(f"\nalpha: {kept} results kept until its share was refused; beta: 3 after it")
        finally:
            client.config_set("maxmemory", 0)
            client.close()


def test_near_its_maxmemory_a_shared_queue_keeps_room_for_the_tenants_not_flooding_it(
        model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    """Two tenants share the queue; one floods it with async jobs. Past twice the headroom below Redis's
    maxmemory the flooding tenant gets 429 (it holds more than its half of the async jobs in Redis, here all of them),
    while the other tenant's async jobs still get in, and so do the flooding tenant's sync requests; every
    accepted job then runs, and the refusals are counted by tenant. Without the band the flood takes Redis up
    to the headroom and the other tenant's async jobs get 503 "the job queue is full"."""
    alpha, beta = {"Authorization": f"Bearer {ALPHA_KEY}"}, {"Authorization": f"Bearer {BETA_KEY}"}
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_REDIS_HEADROOM="0.2",
                                 OPENJEV_API_KEYS_FILE=str(tenants_file(tmp_path))) as stack:
        client = redis.Redis.from_url(stack.redis_url)
        try:
            stack.script(delay=0.3)  # the worker's slots stay busy: the jobs pile up in its queue

            def post(i: int, headers: dict[str, str], path: str = "/v1/jobs") -> httpx.Response:
                return web.post(stack.url + path, json=request(i), headers=headers, timeout=30)

            first = post(0, alpha)
            assert first.status_code == 202, first.text
            mine = {first.json()["id"]: alpha}
            client.config_set("maxmemory", client.info("memory")["used_memory"] + 3_000_000)
            refused = None
            for i in range(1, 2000):
                response = post(i, alpha)
                if response.status_code != 202:
                    refused = response
                    break
                mine[response.json()["id"]] = alpha
            assert refused is not None and refused.status_code == 429, refused and refused.text
            assert refused.json()["detail"]["error_type"] == "rate_limit_error"
            assert "tenant 'alpha' holds" in refused.json()["detail"]["message"], refused.text
            assert "its weight 1 of all tenants' 2" in refused.json()["detail"]["message"], refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert len(mine) >= 10, len(mine)
            memory = client.info("memory")
            assert memory["used_memory"] < memory["maxmemory"] * 0.8  # short of the headroom: room left

            # Jobs ending meanwhile free their payloads (the worker keeps working), which can take Redis back below
            # the band it had just reached: its limit is set again so that what it holds is well inside it.
            in_the_band(client)
            for i in range(5):  # the other tenant's async jobs still get in
                response = post(10_000 + i, beta)
                assert response.status_code == 202, response.text
                mine[response.json()["id"]] = beta
            in_the_band(client)
            again = post(20_000, alpha)
            assert again.status_code == 429, again.text
            assert post(-1, alpha, "/v1/systemone").status_code == 200  # its sync requests are not held

            metrics = web.get(stack.url + "/metrics", headers=alpha, timeout=30).text
            counted = [line for line in metrics.splitlines()
                       if line.startswith('openjev_tenant_limited_total{limit="queue_share",tenant="alpha"}')]
            assert counted and float(counted[0].split()[-1]) >= 2, counted
            crowding = samples(metrics)[("openjev_redis_memory_bytes", (("kind", "crowding"),))]
            assert crowding == int(client.info("memory")["maxmemory"] * 0.6)  # twice the headroom below maxmemory

            stack.script(delay=0.0)
            for headers in (alpha, beta):
                theirs = [job_id for job_id, owner in mine.items() if owner is headers]
                assert final_statuses(stack.url, theirs, 60, headers) == ["succeeded"] * len(theirs)
            assert int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0)) == 0  # none refused
            assert stack.workers[0].alive() and "Traceback" not in stack.workers[0].output()
            print(f"\nalpha: {len(mine) - 5} jobs queued until its share was refused; beta: 5 after it")
        finally:
            client.config_set("maxmemory", 0)
            client.close()

