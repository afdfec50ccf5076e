"""Redis key and channel names, in one place, so the API and the workers agree."""

from __future__ import annotations

PREFIX = "openjev:"

WORKERS = PREFIX + "workers"  # zset: worker id -> last heartbeat (epoch seconds)
JOB_FUNCTION = "evaluate"  # the arq function name a worker registers for evaluation jobs
DONE_CHANNEL = PREFIX + "done"  # pub/sub: "<job id> <outcome JSON>", published when the outcome is stored
ROUND_ROBIN_TURN = PREFIX + "route:turn"  # counter: the next turn under OPENJEV_ROUTING=round_robin


def queue_name(worker_id: str) -> str:
    """The arq queue (a zset) that only this worker pulls from."""
    return f"{PREFIX}queue:{worker_id}"


def wake_key(queue: str) -> str:
    """A list of wake-up tokens for the worker serving `queue`, so it need not poll: a new job's id
    (pushed at the tail, taken in order), or `WAKE_ALL` (pushed at the head)."""
    return f"{queue}:wake"


WAKE_ALL = b"*"  # wake-up token: look at the whole queue and the abort set (a cancel, a freed slot)


def worker_key(worker_id: str) -> str:
    """JSON description of a live worker (queue, capacity, model); expires without heartbeats."""
    return f"{PREFIX}worker:{worker_id}"


def route_info_key(worker_id: str) -> str:
    """Hash: the few fields routing reads (queue, engine_ok, max_jobs, running, avg_job_seconds),
    written with each heartbeat so the submit script need not decode the whole description."""
    return f"{PREFIX}routing:{worker_id}"


def lease_key(worker_id: str) -> str:
    """Who may serve this worker id's queue right now (expires without heartbeats)."""
    return f"{PREFIX}lease:{worker_id}"


def reap_lock_key(worker_id: str) -> str:
    """Held briefly by the worker moving a vanished worker's jobs elsewhere."""
    return f"{PREFIX}reap:{worker_id}"


def job_key(job_id: str) -> str:
    """Hash: the job's status record and, once finished, its outcome."""
    return f"{PREFIX}job:{job_id}"


def idempotency_key(key: str) -> str:
    """The job id already submitted under a client's `Idempotency-Key`."""
    return f"{PREFIX}idem:{key}"
