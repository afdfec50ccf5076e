"""Every Redis key and channel the system uses, ours and arq's, in one place."""

from __future__ import annotations

from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix

PREFIX = "openjev:"

WORKERS = PREFIX + "workers"  # zset: worker id -> last heartbeat (Redis's clock, epoch seconds)
JOB_FUNCTION = "evaluate"  # the arq function name a worker registers for evaluation jobs
DONE_CHANNEL = PREFIX + "done"  # pub/sub: "<job id> <status>", published when an outcome is stored
ROUND_ROBIN_TURN = PREFIX + "route:turn"  # counter: the next turn under OPENJEV_ROUTING=round_robin
REPLICATION_MARK = PREFIX + "replication:mark"  # string: written only so a WAIT has a write to wait for

# arq's keys, per arq job id (a placement, see `placement_id`). arq's worker writes and deletes them;
# our scripts write the job and its queue entry (as `ArqRedis.enqueue_job` would) and move them.
ARQ_JOB = job_key_prefix  # string: the serialised job (function, args, enqueue time)
ARQ_IN_PROGRESS = in_progress_key_prefix  # string: set while a worker runs it
ARQ_RETRY = retry_key_prefix  # counter: which try this is
ARQ_ABORTS = abort_jobs_ss  # zset: arq job id -> when its abort was asked (ms); trimmed by `cancel`


def queue_name(worker_id: str) -> str:
    """The arq queue (a zset of arq job ids) that only this worker pulls from."""
    return f"{PREFIX}queue:{worker_id}"


WAKE_SUFFIX = ":wake"  # queue name + this: the queue's wake-up channel (see `wake_channel`)


def wake_channel(queue: str) -> str:
    """Pub/sub: "job <arq job id>" when a placement is queued on `queue`, "abort <arq job id>" when
    one is cancelled. Its worker acts on them at once; its regular look at the queue and arq's poll of
    aborts are the fallback for any it misses."""
    return queue + WAKE_SUFFIX


def worker_key(worker_id: str) -> str:
    """JSON description of a live worker (queue, capacity, model); expires without heartbeats."""
    return f"{PREFIX}worker:{worker_id}"


def route_info_key(worker_id: str) -> str:
    """Hash: the few fields routing reads (queue, engine_ok, max_jobs, running, avg_job_seconds),
    written with each heartbeat so the submit script need not decode the whole description."""
    return f"{PREFIX}routing:{worker_id}"


def lease_key(worker_id: str) -> str:
    """Who may serve this worker id's queue right now: a token, expiring without renewal."""
    return f"{PREFIX}lease:{worker_id}"


def api_key(api_id: str) -> str:
    """Set while the API process `api_id` is live, renewed by its beat (common/queue/presence.py): a worker
    does not start a sync job whose API, the one process waiting to answer it, let this lapse."""
    return f"{PREFIX}api:{api_id}"


def reap_lock_key(worker_id: str) -> str:
    """Held briefly by the worker moving a vanished worker's jobs elsewhere."""
    return f"{PREFIX}reap:{worker_id}"


def job_key(job_id: str) -> str:
    """Hash: the job's status record and, once finished, its outcome."""
    return f"{PREFIX}job:{job_id}"


def idempotency_key(tenant: str, key: str) -> str:
    """"<job id>:<body digest>" of the job `tenant` submitted under its `Idempotency-Key` (keys are per tenant)."""
    return f"{PREFIX}idem:{tenant}:{key}"


def waiting_key(queue: str) -> str:
    """Zset: the jobs queued on `queue` that no worker has started (arq job id -> when it was placed, Redis
    seconds): the backlog an autoscaler reads, which arq's queue (running jobs included) is not."""
    return queue + ":waiting"


CLOCK_TTL = 24 * 3600  # seconds a queue's virtual time and its tenants' clocks outlive their last use
# Seconds a bounded set's expiry (a tenant's counts, a queue's waiting set) is moved past the
# job that moves it, so the jobs that follow within that time find it far enough and leave it (fewer EXPIREs).
BOUND_SLACK = 60

ASYNC_JOBS = PREFIX + "async"  # zset: every tenant's async jobs in Redis, kept where tenants share the queue: those not
# yet ended (job id -> deadline) and those ended whose records are kept for their readers (job id -> when the record
# expires): what a tenant's share of Redis is taken of when Redis nears its maxmemory (placement.py)
TENANT_PREFIX = PREFIX + "tenant:"  # + "<name>:" + one of the suffixes below (tenant names hold no ':')


def tenant_key(tenant: str, suffix: str) -> str:
    """A tenant's own key: "jobs" (zset: its jobs not yet ended, job id -> deadline), "async" (the same for
    its async jobs), "kept" (its async jobs ended and kept for their readers, job id -> when the record expires;
    only where tenants share the queue), "rate" (its rate limiter's theoretical arrival time, ms) or
    "clock:<lane>" (the fair start, ms, its next job in that lane gets)."""
    return f"{TENANT_PREFIX}{tenant}:{suffix}"


def placement_id(job_id: str, placement: int) -> str:
    """The arq job id of a job's `placement`-th placement (1 when submitted, +1 per move). A job
    moved off a vanished worker gets new arq keys, so that worker, should it come back, can neither
    clear nor finish the new copy: its outcome is refused (fencing) and its engine calls aborted."""
    return f"{job_id}.{placement}"


def job_of(arq_job_id: str) -> str:
    """The job id of an arq job id made by `placement_id`."""
    return arq_job_id.rpartition(".")[0]
