"""`GET /metrics`: Prometheus text with the request, stage, queue and worker figures, behind the key."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis
from prometheus_client.parser import text_string_to_metric_families

from common.queue.membership import RESTING_HEARTBEAT_INTERVAL
from harness.processes import start_api
from harness.stacks import Stack
from harness.web import web
from tests.test_api_contract import NOUL, SCORE, body


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metrics_once(url: str, ready: Callable[[dict[tuple[str, tuple], float]], bool],
                 timeout: float = 4 * RESTING_HEARTBEAT_INTERVAL + 5) -> dict[tuple[str, tuple], float]:
    """/metrics' samples once `ready` holds for them: a worker's figures arrive with its next heartbeat
    (every RESTING_HEARTBEAT_INTERVAL s at rest)."""
    deadline = time.monotonic() + timeout
    while True:
        m = samples(web.get(url + "/metrics", timeout=30).text)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_metrics_count_requests_stages_queue_and_worker_figures(scripted_stack: Stack) -> None:
    for _ in range(2):
        assert scripted_stack.post(body({"a": NOUL, "b": SCORE})).status_code == 200
    assert scripted_stack.post({**body(), "model": "nope"}).status_code == 400
    r = web.get(scripted_stack.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metrics_once(scripted_stack.url, lambda m: m.get(("openjev_worker_jobs_done", (("worker", "w0"),)), 0) >= 2)
    assert m[("openjev_requests_total", (("route", "/v1/systemone"), ("status", "200")))] >= 2
    assert m[("openjev_requests_total", (("route", "/v1/systemone"), ("status", "400")))] >= 1
    for stage in ("queue", "prepare", "prefill", "branches"):
        assert m[("openjev_stage_seconds_count", (("stage", stage),))] >= 2
    assert m[("openjev_worker_jobs_ended", (("outcome", "succeeded"), ("worker", "w0")))] >= 2
    assert m[("openjev_live_workers", ())] == 1
    assert m[("openjev_redis_up", ())] == 1
    assert m[("openjev_queue_depth", (("worker", "w0"),))] == 0
    assert m[("openjev_worker_jobs_done", (("worker", "w0"),))] >= 2
    assert m[("openjev_worker_branch_prompt_tokens", (("worker", "w0"),))] > 0
    assert m[("openjev_cached_tokens_total", ())] > 0
    with redis.Redis.from_url(scripted_stack.redis_url) as client:
        limit = int(client.config_get("maxmemory")["maxmemory"])  # serve's Redis has one, a container's none
    assert m[("openjev_redis_memory_bytes", (("kind", "used"),))] > 0
    assert m[("openjev_redis_memory_bytes", (("kind", "maxmemory"),))] == limit
    assert m[("openjev_redis_memory_bytes", (("kind", "admission"),))] == int(limit * 0.9)  # the default headroom
    assert ("openjev_redis_memory_bytes", (("kind", "crowding"),)) not in m  # one tenant's queue has no band


def test_metrics_need_the_key_when_one_is_set(scripted_stack: Stack) -> None:
    api = start_api(scripted_stack.log_dir, {**scripted_stack.env, "OPENJEV_API_KEY": "metrics-key"})
    try:
        assert web.get(api.url + "/metrics").status_code == 403
        ok = web.get(api.url + "/metrics", headers={"Authorization": "Bearer metrics-key"})
        assert ok.status_code == 200 and "openjev_live_workers" in ok.text
    finally:
        api.stop()


def test_engine_errors_and_aborts_are_counted_per_worker(scripted_stack: Stack) -> None:
    # a 400 fails the job at once (a 5xx would run it again, test_engine_failures.py)
    scripted_stack.script(delay=2.0, fail_rid_suffix=".b1", fail_status=400, fail_delay=0.5)
    try:
        r = scripted_stack.post(body({"a": NOUL, "b": NOUL, "c": NOUL}))
    finally:
        scripted_stack.script(delay=0.0, fail_rid_suffix=None, fail_status=500, fail_delay=0.0)
    assert r.status_code == 502
    failed = ("openjev_worker_jobs_ended", (("outcome", "failed"), ("worker", "w0")))
    # The aborts are counted as they are sent and the ending once stored, so a heartbeat may carry the first
    # without the second: wait for a heartbeat that carries both.
    m = metrics_once(scripted_stack.url,
                     lambda m: m.get(("openjev_worker_aborts_sent", (("worker", "w0"),)), 0) >= 2
                     and m.get(failed, 0) >= 1)
    assert m[("openjev_worker_engine_errors", (("worker", "w0"),))] >= 1
    assert m[("openjev_worker_aborts_sent", (("worker", "w0"),))] >= 2  # b0 and b2 were live
    assert m[failed] >= 1


def test_64_question_jobs_under_contention_keep_their_batches_whole(scripted_stack: Stack) -> None:
    """Issue 29: 16 requests of 64 questions at once on one worker (64 branch slots, 16 jobs at a time).
    Each job's branches reach the engine in at most two calls (a warm call besides), where slots freed a
    few at a time used to go out as calls of 1-4 prompts; /metrics shows the calls by prompts per call."""
    questions = {f"q{i}": {**NOUL, "instructions": f"Is the customer asking for money back? ({i})"}
                 for i in range(64)}
    before = len(scripted_stack.engine_stats()["calls"])
    scripted_stack.script(delay=0.2)  # each call takes a while: the jobs overlap and compete for slots
    try:
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: scripted_stack.post(body(questions)).status_code, range(16)))
    finally:
        scripted_stack.script(delay=0.0)
    assert statuses == [200] * 16
    calls = scripted_stack.engine_stats()["calls"][before:]
    branch_calls = Counter(rids[0].split(".")[0] for rids in calls if ".b" in rids[0])
    assert len(branch_calls) == 16 and max(branch_calls.values()) <= 2, branch_calls
    assert sum(len(rids) for rids in calls if ".b" in rids[0]) == 16 * 64
    worker = (("worker", "w0"),)
    m = metrics_once(scripted_stack.url, lambda m: m.get(("openjev_worker_branch_call_prompts_count", worker), 0)
                     >= sum(branch_calls.values()))
    assert m[("openjev_worker_branch_call_prompts_count", worker)] >= sum(branch_calls.values())
    small = m[("openjev_worker_branch_call_prompts_bucket", (("le", "8.0"), *worker))]
    assert small <= m[("openjev_worker_branch_call_prompts_count", worker)] - sum(branch_calls.values())
