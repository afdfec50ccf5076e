"""Prometheus metrics for `GET /metrics`: what this API process saw (requests, latency and its
stages, outcomes), and, read from Redis at scrape time, the queue and every live worker's figures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from common.jobs import JobOutcome, JobStatus
from common.queue.membership import BATCH_BUCKETS, Backlog, WorkerInfo
from common.queue.placement import RedisMemory

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WORKER_FIGURES = {  # WorkerCounters field -> help text
    "jobs_done": "Jobs answered by the worker",
    "jobs_failed": "Jobs the worker ran that ended in an engine error, abort or timeout",
    "warm_prompt_tokens": "Prompt tokens of warm calls",
    "warm_cached_tokens": "Warm-call prompt tokens found in the engine's prefix cache",
    "branch_prompt_tokens": "Prompt tokens of branch calls",
    "branch_cached_tokens": "Branch-call prompt tokens found in the engine's prefix cache",
    "engine_errors": "Engine calls that failed",
    "jobs_rerun": "Jobs queued to run again after their engine failed them",
    "aborts_sent": "Abort requests sent to the engine for cancelled branch calls",
}


class ApiMetrics:
    """One registry per app; recorded where the events happen, rendered on scrape."""

    def __init__(self, tenant_names: Callable[[], list[str]] = lambda: []) -> None:
        """`tenant_names`: the tenants in force (the keys file's), the only values the tenant label takes."""
        self.registry = CollectorRegistry()
        self.tenant_names = tenant_names
        r = self.registry
        self.requests = Counter("openjev_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("openjev_request_seconds", "HTTP request latency, end to end", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.stages = Histogram("openjev_stage_seconds", "Evaluation latency by stage", ["stage"],
                                buckets=LATENCY_BUCKETS, registry=r)
        self.outcomes = Counter("openjev_jobs", "Jobs this API ended itself (client hang-up, deadline, DELETE, "
                                "overdue), by outcome; workers count the endings they store", ["outcome"], registry=r)
        self.prompt_tokens = Counter("openjev_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.cached_tokens = Counter("openjev_cached_tokens", "Branch tokens served from the prefix cache",
                                     registry=r)
        self.queue_depth = Gauge("openjev_queue_depth", "Jobs waiting or running per worker queue", ["worker"],
                                 registry=r)
        self.live_workers = Gauge("openjev_live_workers", "Workers with a fresh heartbeat and a healthy engine",
                                  registry=r)
        self.waiting = Gauge("openjev_queue_waiting_jobs", "Jobs queued on each heartbeating worker that no worker "
                             "has started (running jobs not counted): the backlog to scale on", ["worker"], registry=r)
        self.oldest_waiting = Gauge("openjev_queue_oldest_waiting_seconds", "How long the oldest job waiting on each "
                                    "heartbeating worker has waited", ["worker"], registry=r)
        self.fleet_waiting = Gauge("openjev_fleet_waiting_jobs", "Jobs waiting to start, all workers together",
                                   registry=r)
        self.fleet_oldest_waiting = Gauge("openjev_fleet_oldest_waiting_seconds", "How long the oldest job waiting "
                                          "anywhere has waited", registry=r)
        self.redis_up = Gauge("openjev_redis_up", "1 when the queue answered this scrape", registry=r)
        self.redis_memory = Gauge("openjev_redis_memory_bytes", "The queue's Redis memory: used, its maxmemory (0: "
                                  "none), admission, past which the API takes no new async job (maxmemory less "
                                  "OPENJEV_REDIS_HEADROOM; sync jobs may use half of it), and, where tenants share "
                                  "the queue, crowding, past which it takes none from a tenant holding more than its "
                                  "weight's share of the async jobs in Redis, queued or kept (less twice the "
                                  "headroom); absent when Redis refuses INFO", ["kind"], registry=r)
        self.worker_running = Gauge("openjev_worker_running_jobs", "Jobs being evaluated per worker", ["worker"],
                                    registry=r)
        self.worker_endings = Gauge("openjev_worker_jobs_ended", "Jobs a worker ended, by the outcome it stored "
                                    "(refused: it had ended or moved meanwhile; gone: a sync job not run, its API "
                                    "process gone), since the worker started", ["worker", "outcome"], registry=r)
        self.tenant_requests = Counter("openjev_tenant_requests", "API requests (/v1/...) by tenant and status",
                                       ["tenant", "status"], registry=r)
        self.tenant_refusals = Counter("openjev_tenant_limited", "Requests refused with 429 by tenant and limit",
                                       ["tenant", "limit"], registry=r)
        self.tenant_prompt_tokens = Counter("openjev_tenant_prompt_tokens", "Prompt tokens of accepted jobs (sent to "
                                            "the engine: warm + branches), by tenant", ["tenant"], registry=r)
        self.tenant_cached_tokens = Counter("openjev_tenant_cached_tokens", "Branch tokens served from the prefix "
                                            "cache for answered sync requests, by tenant", ["tenant"], registry=r)
        self.tenant_queue_wait = Histogram("openjev_tenant_queue_wait_seconds", "Time answered sync requests waited "
                                           "in the queue, by tenant", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.worker_figures = {
            name: Gauge(f"openjev_worker_{name}", text + " (since the worker started)", ["worker"], registry=r)
            for name, text in WORKER_FIGURES.items()}
        self.batching = BranchCallSizes()
        r.register(self.batching)

    def observe_request(self, route: str, status: int, seconds: float, tenant: str | None = None) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if tenant is not None and route.startswith("/v1/") and tenant in self.tenant_names():
            self.tenant_requests.labels(tenant, str(status)).inc()

    def observe_refusal(self, tenant: str, limit: str) -> None:
        """A request refused with 429 at one of its tenant's limits."""
        self.tenant_refusals.labels(tenant, limit).inc()

    def observe_acceptance(self, tenant: str, prompt_tokens: int) -> None:
        """A job accepted onto the queue, sync or async, with the prompt tokens it will send."""
        self.tenant_prompt_tokens.labels(tenant).inc(prompt_tokens)

    def observe_ending(self, status: JobStatus) -> None:
        """A job this API ended (sync or async), counted where it ended."""
        self.outcomes.labels(status.value).inc()

    def observe_delivery(self, outcome: JobOutcome, prepare_seconds: float, tenant: str) -> None:
        """A sync answer delivered: its stage timings and tokens."""
        if outcome.result is None:
            return
        self.tenant_queue_wait.labels(tenant).observe(outcome.timings.queue)
        if outcome.cached_tokens is not None:
            self.tenant_cached_tokens.labels(tenant).inc(outcome.cached_tokens)
        t = outcome.timings
        for stage, seconds in (("queue", t.queue), ("prepare", prepare_seconds), ("prefill", t.prefill),
                               ("branches", t.branches)):
            self.stages.labels(stage).observe(seconds)
        self.prompt_tokens.inc(outcome.result["usage"]["input_tokens"])
        if outcome.cached_tokens is not None:
            self.cached_tokens.inc(outcome.cached_tokens)

    def render(self, workers: list[WorkerInfo] | None, lengths: dict[str, int],
               backlog: dict[str, Backlog] | None = None, memory: RedisMemory | None = None) -> bytes:
        """The exposition text; `workers` None means Redis could not be read for this scrape. `backlog`: each
        heartbeating worker's jobs waiting to start, by worker id; `memory`: Redis's, and where placements stop."""
        self.redis_up.set(0 if workers is None else 1)
        self.redis_memory.clear()
        if memory is not None:
            for kind, value in (("used", memory.used), ("maxmemory", memory.limit), ("admission", memory.admission),
                                ("crowding", memory.crowding)):
                if value is not None:  # crowding: where tenants share the queue
                    self.redis_memory.labels(kind).set(value)
        for gauge in (self.queue_depth, self.worker_running, self.worker_endings, self.waiting, self.oldest_waiting,
                      *self.worker_figures.values()):
            gauge.clear()  # workers that left must not linger as stale series
        for worker_id, waiting in (backlog or {}).items():
            self.waiting.labels(worker_id).set(waiting.waiting)
            self.oldest_waiting.labels(worker_id).set(waiting.oldest_seconds)
        self.fleet_waiting.set(sum(b.waiting for b in (backlog or {}).values()))
        self.fleet_oldest_waiting.set(max((b.oldest_seconds for b in (backlog or {}).values()), default=0.0))
        for worker in workers or []:
            self.queue_depth.labels(worker.id).set(lengths.get(worker.id, 0))
            self.worker_running.labels(worker.id).set(worker.running)
            counters = worker.counters.model_dump()
            for name, gauge in self.worker_figures.items():
                gauge.labels(worker.id).set(counters.get(name, 0))
            for outcome, count in worker.counters.endings.items():
                self.worker_endings.labels(worker.id, outcome).set(count)
        self.live_workers.set(len(workers or []))
        self.batching.workers = workers or []
        return generate_latest(self.registry)


class BranchCallSizes(Collector):
    """`openjev_worker_branch_call_prompts`: each worker's branch engine calls by prompts per call (a
    histogram, since the worker started): how whole its batches stay. Read from the workers' heartbeats,
    which carry the bucket counts; its _count is the worker's branch engine calls."""

    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("openjev_worker_branch_call_prompts", "Branch engine calls by prompts per "
                                       "call (since the worker started)", labels=["worker"])
        for worker in self.workers:
            counts = worker.counters.branch_call_prompts
            buckets, total = [], 0
            for bound in [*map(str, BATCH_BUCKETS), "+Inf"]:
                total += counts.get(bound, 0)
                buckets.append((bound if bound == "+Inf" else str(float(bound)), total))  # le="8.0", as Histogram
            family.add_metric([worker.id], buckets, sum_value=worker.counters.branch_calls)
        yield family
