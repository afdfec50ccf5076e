"""Tenants end to end on real processes (Redis, a worker, API processes, the scripted engine): each
tenant's key, its own jobs (another tenant's are 404), its own idempotency keys, its limits answered
429 with Retry-After and RateLimit fields by every API replica alike, the keys file re-read without a
restart, sync requests started before a queued backlog, and fair shares between two backlogs. The keys
file's own rules are checked without processes."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from redis import Redis

from api.app import create_app as create_api
from api.preparation import JobPreparer
from common.prompt import PromptCompiler
from common.queue import keys
from common.settings import Settings
from common.tenants import KeysFileError, TenantDirectory, parse_keys_file
from common.tokenizer import qwen36_tokenizer
from harness.processes import start_api, start_scripted_engine
from harness.redis_servers import fresh_redis
from harness.stacks import Stack, build_stack, isolated_scripted_stack
from harness.web import web
from openjev.embedded_redis import RedisServer
from tests.test_api_contract import NOUL, body

pytestmark = pytest.mark.integration

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"
KEY_C = "tenant-c-key-0123456789"
KEY_D = "tenant-d-key-0123456789"
KEY_E = "tenant-e-key-0123456789"
KEY_Z = "tenant-z-key-0123456789"
KEYS_FILE = f"""
[tenants.alpha]
key = "{KEY_A}"
requests_per_minute = 5
max_queued_jobs = 400
operator = true

[tenants.beta]
key_sha256 = "{hashlib.sha256(KEY_B.encode()).hexdigest()}"

[tenants.delta]
key = "{KEY_D}"

[tenants.zeta]
key = "{KEY_Z}"
max_concurrent_jobs = 1

[tenants.epsilon]
key = "{KEY_E}"
requests_per_minute = 60
burst = 1
"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- the keys file, without processes ---------------------------------------------------------------

def test_a_keys_file_gives_each_tenant_its_key_limits_and_weight() -> None:
    directory = TenantDirectory(parse_keys_file(KEYS_FILE + "weight = 3\n", "keys.toml"))
    alpha, beta = directory.authenticate(KEY_A.encode()), directory.authenticate(KEY_B.encode())
    last = directory.authenticate(KEY_E.encode())  # the file's last table: the appended weight is its
    assert alpha is not None and alpha.name == "alpha" and alpha.operator
    assert alpha.limits.requests_per_minute == 5 and alpha.limits.max_concurrent_jobs is None
    assert beta is not None and beta.name == "beta" and beta.weight == 1.0 and not beta.operator  # by its sha256
    assert last is not None and last.weight == 3.0 and last.limits.burst == 1
    assert directory.authenticate(b"tenant-a-key-012345678") is None  # a prefix of a key is no key
    assert directory.authenticate(KEY_A.encode() + b"9") is None
    assert directory.shared_weight == sum(t.weight for t in directory.tenants.values()) == 3.0 + len(
        directory.tenants) - 1  # the tenants share the queue's memory by weight; one tenant alone shares nothing
    for alone in (TenantDirectory.single("a-key-0123456789abc"), TenantDirectory.single(None)):
        assert alone.shared_weight == 0


@pytest.mark.parametrize(("text", "line", "says"), [
    ('[tenants.a]\nkey = "short"\n', 1, "at least 16"),
    ('[tenants.a]\nkey = "k-0123456789abcdef"\n\n[tenants.b]\nkey = "k-0123456789abcdef"\n', 4, "same key"),
    ('[tenants.a]\nkey = "k-0123456789abcdef"\nrequests_per_minit = 5\n', 1, "unknown field"),
    ('\n\n[tenants.a]\nkey = "k-0123456789abcdef"\nmax_queued_jobs = 0\n', 3, "at least 1"),
    ('[tenants.a]\nkey = "k-0123456789abcdef"\n[tenants."b c"]\nkey = "k-0123456789abcdefg"\n', 3, "tenant name"),
    ('[tenants.a]\nkey = "k-0123456789abcdef"\nkey_sha256 = "00"\n', 1, "exactly one"),
    ('[tenants.a]\nkey = "k-0123456789abcdef\n', 2, "not valid TOML"),
])
def test_a_malformed_keys_file_is_refused_naming_its_line(text: str, line: int, says: str) -> None:
    with pytest.raises(KeysFileError) as refused:
        parse_keys_file(text, "keys.toml")
    message = str(refused.value)
    assert says in message and f"line {line}" in message, message
    assert "k-0123456789abcdef" not in message  # never the key itself


def test_the_api_refuses_to_start_on_a_malformed_keys_file(tmp_path: Path, log_dir: Path) -> None:
    bad = tmp_path / "keys.toml"
    bad.write_text('[tenants.a]\nkey = "k-0123456789abcdef"\nweight = -1\n')
    with pytest.raises(RuntimeError) as failed:
        start_api(log_dir, {"OPENJEV_API_KEYS_FILE": str(bad), "OPENJEV_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert "line 1" in str(failed.value) and "weight" in str(failed.value)


# --- the tenant's gate while Redis is down, in-process -------------------------------------------------

async def test_while_redis_is_down_a_rate_limited_tenant_gets_503_and_the_log_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The rate gate and the tenant's usage reach Redis before any route does: while it is down they answer
    503 (the gate), a usage of null (GET /v1/limits) and /metrics its `openjev_redis_up 0`, and the API's log
    gives the cause once, then that Redis works again. The app in-process (its lifespan and middleware), a real
    Redis stopped and restarted."""
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS_FILE)
    server = RedisServer.on(tmp_path / "redis")
    server.start()
    server.wait_ready()
    settings = Settings(redis_url=server.url, api_keys_file=keys_file)
    app = create_api(settings, JobPreparer(settings, PromptCompiler.for_tokenizer(qwen36_tokenizer())))
    failed, back = "the job queue's Redis failed", "the job queue's Redis works again"
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://openjev", headers=auth(KEY_A)) as client:
            assert (await client.get("/v1/limits")).json()["tenant"]["usage"]["requests_remaining"] == 5
            server.stop()
            with caplog.at_level(logging.INFO, logger="openjev.api"):
                for _ in range(3):
                    refused = await client.post("/v1/systemone", json=body("While Redis is down."))
                    assert refused.status_code == 503, refused.text
                    assert refused.json()["detail"]["error_type"] == "unavailable_error"
                    assert "unreachable" in refused.json()["detail"]["message"]
                    assert int(refused.headers["retry-after"]) >= 1
                warnings = [r for r in caplog.records if r.getMessage().startswith(failed)]
                assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text  # not one each
                assert "Error" in warnings[0].getMessage()  # the cause: the client's error, as it was raised
                limits = await client.get("/v1/limits")
                assert limits.status_code == 200 and limits.json()["tenant"]["usage"] is None
                assert limits.json()["redis"] == "unreachable"
                scrape = await client.get("/metrics")  # the fleet and Redis's memory, read side by side, both fail
                assert scrape.status_code == 200 and "openjev_redis_up 0.0" in scrape.text, scrape.text
                assert "openjev_redis_memory_bytes{" not in scrape.text
                assert back not in caplog.text
                server.start()
                server.wait_ready()
                assert (await client.get("/v1/limits")).json()["tenant"]["usage"]["requests_remaining"] == 5
                scrape = await client.get("/metrics")
                assert "openjev_redis_up 1.0" in scrape.text, scrape.text
                assert 'openjev_redis_memory_bytes{kind="crowding"}' in scrape.text  # tenants share this queue
                assert sum(back in r.getMessage() for r in caplog.records) == 1, caplog.text
    finally:
        server.stop()
    assert KEY_A not in caplog.text and server.password not in caplog.text


# --- the stack ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def tenant_stack(keys_file: Path, model_dir: Path, log_dir: Path) -> Iterator[Stack]:
    """A scripted stack whose API reads the keys file, on its own Redis (backlogs stay here); a worker of
    two job slots, so a few jobs make a queue."""
    with fresh_redis() as redis_url:
        stack = build_stack(redis_url, start_scripted_engine(log_dir), model_dir, log_dir,
                            OPENJEV_API_KEYS_FILE=str(keys_file), OPENJEV_MAX_CONCURRENT_REQUESTS="2",
                            OPENJEV_WORKER_POLL_DELAY="5")
        try:
            yield stack
        finally:
            stack.stop()


@pytest.fixture(autouse=True)
def _quiet_engine(request: pytest.FixtureRequest) -> None:
    if "tenant_stack" in request.fixturenames:
        request.getfixturevalue("tenant_stack").script(delay=0.0)


def submit(stack: Stack, key: str, payload: dict | None = None, url: str | None = None, **headers: str) \
        -> httpx.Response:
    return web.post((url or stack.url) + "/v1/jobs", json=payload or body(), headers={**auth(key), **headers},
                    timeout=30)


def wait_for(stack: Stack, key: str, job_id: str) -> dict:
    return web.get(f"{stack.url}/v1/jobs/{job_id}", params={"wait": 20}, headers=auth(key), timeout=30).json()


def test_another_tenants_job_is_not_found_for_reading_or_cancelling(tenant_stack: Stack) -> None:
    job = submit(tenant_stack, KEY_B).json()
    for method in ("GET", "DELETE"):
        r = web.request(method, f"{tenant_stack.url}/v1/jobs/{job['id']}", headers=auth(KEY_A), timeout=30)
        assert r.status_code == 404, r.text
        assert r.json()["detail"]["error_type"] == "not_found_error"  # as if it did not exist
    assert wait_for(tenant_stack, KEY_B, job["id"])["status"] == "succeeded"  # its owner's, untouched


def test_the_same_idempotency_key_in_two_tenants_makes_two_jobs(tenant_stack: Stack) -> None:
    a = submit(tenant_stack, KEY_A, **{"Idempotency-Key": "ticket-7"})
    b = submit(tenant_stack, KEY_B, **{"Idempotency-Key": "ticket-7"})
    assert a.status_code == 202 and b.status_code == 202, (a.text, b.text)
    assert a.json()["id"] != b.json()["id"]
    again = submit(tenant_stack, KEY_B, **{"Idempotency-Key": "ticket-7"})
    assert again.status_code == 200 and again.json()["id"] == b.json()["id"]  # within a tenant: the same job


def test_limits_show_a_tenant_its_own_limits_and_usage(tenant_stack: Stack) -> None:
    got = web.get(tenant_stack.url + "/v1/limits", headers=auth(KEY_B), timeout=30).json()
    assert got["tenant"]["name"] == "beta"
    everyone = parse_keys_file(KEYS_FILE, "keys.toml")
    assert got["tenant"]["queue_share"] == round(1 / sum(t.weight for t in everyone), 6)  # beta weighs 1
    assert got["tenant"]["limits"] == {"requests_per_minute": None, "burst": None, "max_concurrent_jobs": None,
                                       "max_queued_jobs": None}
    assert "alpha" not in str(got)
    assert set(got["tenant"]["usage"]) == {"jobs", "queued_or_running_async_jobs", "requests_remaining"}


def test_a_tenant_over_its_rate_gets_429_with_headers_from_every_replica(tenant_stack: Stack) -> None:
    second = start_api(tenant_stack.log_dir, tenant_stack.env)
    tenant_stack.extra.append(second)
    urls = [tenant_stack.url, second.url, tenant_stack.url, second.url, tenant_stack.url]
    answers = [submit(tenant_stack, KEY_A, url=url) for url in urls]
    answers += [submit(tenant_stack, KEY_A, url=second.url)]
    allowed = [r for r in answers if r.status_code == 202]
    refused = [r for r in answers if r.status_code == 429]
    assert len(allowed) + len(refused) == 6 and refused, [r.status_code for r in answers]
    assert len(allowed) <= 5  # five a minute across both replicas together, never five each
    r = refused[-1]
    assert r.json()["detail"]["error_type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 12
    assert r.headers["ratelimit-limit"] == "5" and r.headers["ratelimit-remaining"] == "0"
    assert r.headers["ratelimit-policy"] == "5;w=60"
    assert "ratelimit-remaining" in allowed[0].headers
    assert submit(tenant_stack, KEY_B, url=second.url).status_code == 202  # beta has no such limit


def test_a_tenant_at_its_job_limit_gets_429_and_the_refusal_is_counted(tenant_stack: Stack) -> None:
    tenant_stack.script(delay=2.0)
    running = submit(tenant_stack, KEY_Z, body({"q": NOUL}, state="zeta's one job"))
    assert running.status_code == 202, running.text
    refused = submit(tenant_stack, KEY_Z, body({"q": NOUL}, state="zeta's second job"))
    assert refused.status_code == 429, refused.text
    assert refused.json()["detail"] == {
        "error_type": "rate_limit_error",
        "message": "tenant 'zeta' is at its limit max_concurrent_jobs = 1; retry once one of its jobs has ended"}
    assert refused.headers["retry-after"] == "1"
    assert submit(tenant_stack, KEY_D).status_code == 202  # another tenant is not held by it
    text = web.get(tenant_stack.url + "/metrics", headers=auth(KEY_A), timeout=30).text
    assert 'openjev_tenant_limited_total{limit="max_concurrent_jobs",tenant="zeta"} 1.0' in text.splitlines()
    tenant_stack.script(delay=0.0)
    assert wait_for(tenant_stack, KEY_Z, running.json()["id"])["status"] == "succeeded"


def test_a_changed_keys_file_takes_effect_without_a_restart(tenant_stack: Stack, keys_file: Path) -> None:
    assert submit(tenant_stack, KEY_C).status_code == 401
    keys_file.write_text(KEYS_FILE + f'\n[tenants.gamma]\nkey = "{KEY_C}"\n')
    try:
        deadline = time.monotonic() + 15
        while (status := submit(tenant_stack, KEY_C).status_code) == 401 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status == 202
        keys_file.write_text("[tenants.broken\n")  # a broken edit: the tenants before it stay in force
        deadline = time.monotonic() + 15
        while "keys file not reloaded" not in tenant_stack.api.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "line 1" in tenant_stack.api.output()
        assert submit(tenant_stack, KEY_C).status_code == 202
    finally:
        keys_file.write_text(KEYS_FILE)
    deadline = time.monotonic() + 15
    while (status := submit(tenant_stack, KEY_C).status_code) != 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 401  # gamma removed again
    assert KEY_C not in tenant_stack.api.output()  # keys never reach the log


def test_another_tenants_backlog_does_not_turn_a_request_away_that_would_start_next(
        model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    """Admission (529 when no worker could finish a job before its deadline) counts the jobs queued ahead in
    fair order: alpha's backlog of interactive jobs turns alpha's own sync request away, but not beta's,
    which starts before that backlog. Before, beta's was refused as if it waited behind all of alpha's."""
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[tenants.alpha]\nkey = "{KEY_A}"\n\n[tenants.beta]\nkey = "{KEY_B}"\n')
    with isolated_scripted_stack(model_dir, log_dir, OPENJEV_API_KEYS_FILE=str(keys_file),
                                 OPENJEV_MAX_CONCURRENT_REQUESTS="2", OPENJEV_REQUEST_TIMEOUT="10") as stack:
        stack.script(delay=0.5)  # a job: a warm call and a branch, about 1 s

        def sync(key: str, state: str) -> httpx.Response:
            return web.post(stack.url + "/v1/systemone", json=body({"q": NOUL}, state=state), headers=auth(key),
                            timeout=30)

        for n in range(2):  # the worker learns how long a job takes (its heartbeat carries it)
            assert sync(KEY_B, f"learn {n}").status_code == 200
        backlog = []
        for n in range(40):  # about 20 s of alpha's interactive work queued: past a sync request's 10 s
            payload = {**body({"q": NOUL}, state=f"alpha backlog {n}"), "x_priority": "interactive"}
            response = submit(stack, KEY_A, payload)
            assert response.status_code == 202, response.text
            backlog.append(response.json()["id"])
        try:
            refused = sync(KEY_A, "alpha, behind its own backlog")
            assert refused.status_code == 529, refused.text
            assert refused.json()["detail"]["error_type"] == "overloaded_error"
            started = time.monotonic()
            answered = sync(KEY_B, "beta, next in fair order")
            assert answered.status_code == 200, answered.text
            assert time.monotonic() - started < 10
        finally:
            for job_id in backlog:  # not started: taken off the queue at once
                web.delete(f"{stack.url}/v1/jobs/{job_id}", headers=auth(KEY_A), timeout=30)


def record_times(redis_url: str, job_ids: list[str]) -> dict[str, tuple[float, float]]:
    """Each job's submission and start (its record's, Redis's clock)."""
    client = Redis.from_url(redis_url)
    try:
        return {job_id: tuple(float(t) for t in client.hmget(keys.job_key(job_id), "created_at", "started_at"))
                for job_id in job_ids}
    finally:
        client.close()


def test_a_sync_request_starts_before_a_queued_backlog(tenant_stack: Stack) -> None:
    tenant_stack.script(delay=0.25)
    with ThreadPoolExecutor(4) as pool:
        backlog = list(pool.map(
            lambda n: submit(tenant_stack, KEY_B, body({"q": NOUL}, state=f"backlog {n}")).json()["id"], range(30)))
    answer = web.post(tenant_stack.url + "/v1/systemone", json=body({"q": NOUL}, state="someone waits"),
                      headers=auth(KEY_B), timeout=60)
    answered_at = time.time()
    assert answer.status_code == 200, answer.text
    ended = [wait_for(tenant_stack, KEY_B, job_id)["status"] for job_id in backlog]
    assert ended == ["succeeded"] * 30  # and the backlog still all succeeds
    client = Redis.from_url(tenant_stack.redis_url)
    try:
        backlog_starts = [float(client.hget(keys.job_key(j), "started_at")) for j in backlog]
    finally:
        client.close()
    # Two slots, 0.5 s a job: in arrival order the sync request would wait for all 30 (~7.5 s). It was
    # answered while most of the backlog still waited to start.
    assert sum(start > answered_at for start in backlog_starts) >= 15
    queue_ms = float(answer.headers["server-timing"].split("queue;dur=")[1].split(",")[0])
    assert queue_ms < 1000, answer.headers["server-timing"]


def test_a_second_tenants_jobs_start_among_the_first_tenants_backlog(tenant_stack: Stack) -> None:
    tenant_stack.script(delay=0.1)
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda n: submit(tenant_stack, KEY_B, body({"q": NOUL}, state=f"beta {n}")).json()["id"],
                              range(40)))
    second = [submit(tenant_stack, KEY_D, body({"q": NOUL}, state=f"delta {n}")).json()["id"] for n in range(3)]
    for key, job_id in [*((KEY_B, j) for j in first), *((KEY_D, j) for j in second)]:
        assert wait_for(tenant_stack, key, job_id)["status"] == "succeeded"
    times = record_times(tenant_stack.redis_url, [*first, *second])
    submitted, started = times[second[0]]
    passed = [job for job in first if submitted < times[job][1] < started]
    # beta's 40 were queued first; delta's first job waited for a slot to free, not for beta's backlog
    assert len(passed) <= 3, (len(passed), sum(times[job][1] > submitted for job in first))
    assert max(times[job][1] for job in second) < max(times[job][1] for job in first)


def test_batch_and_smoke_wait_out_a_429_and_get_through(tenant_stack: Stack, tmp_path: Path) -> None:
    from openjev.batch import BatchOptions, run_batch
    from openjev.smoke import SmokeClient

    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps(f"epsilon ticket {n}") + "\n" for n in range(6)))
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps({"q": NOUL}))
    output = tmp_path / "out.jsonl"
    # one submission at a time, one a second: four in flight at once meet 429s, which batch waits out
    code = run_batch(BatchOptions(input=lines, output=output, url=tenant_stack.url, questions=questions,
                                  concurrency=4, api_key=KEY_E, progress=False))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert code == 0 and all("result" in r for r in records), records
    client = SmokeClient(tenant_stack.url, KEY_E, 30)
    assert submit(tenant_stack, KEY_E).status_code == 429  # batch's last submission was less than a second ago
    try:
        exchange = client.send("POST", "/v1/jobs", json=body())
    finally:
        client.close()
    assert exchange.response.status_code == 202 and exchange.attempts >= 2  # a 429 first, then through


def test_metrics_show_the_backlog_waiting_to_start_and_only_to_an_operator(tenant_stack: Stack) -> None:
    tenant_stack.script(delay=1.0)
    jobs = [submit(tenant_stack, KEY_D, body({"q": NOUL}, state=f"backlog metric {n}")).json()["id"]
            for n in range(6)]
    assert web.get(tenant_stack.url + "/metrics", headers=auth(KEY_D), timeout=30).status_code == 403
    deadline = time.monotonic() + 20
    seen = None
    while time.monotonic() < deadline:
        text = web.get(tenant_stack.url + "/metrics", headers=auth(KEY_A), timeout=30).text
        figures = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                   if line.startswith(("openjev_queue_waiting_jobs{", "openjev_queue_depth{", "openjev_fleet_"))}
        seen = figures
        if figures.get('openjev_queue_waiting_jobs{worker="w0"}') == 4:
            break
        time.sleep(0.1)
    assert seen is not None and seen['openjev_queue_waiting_jobs{worker="w0"}'] == 4, seen  # two of six run
    assert seen["openjev_fleet_waiting_jobs"] == 4 and seen["openjev_fleet_oldest_waiting_seconds"] > 0
    assert 'openjev_tenant_requests_total{status="202",tenant="delta"}' in text
    tenant_stack.script(delay=0.0)
    for job_id in jobs:
        assert wait_for(tenant_stack, KEY_D, job_id)["status"] == "succeeded"
