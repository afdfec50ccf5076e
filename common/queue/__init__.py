"""The queue between the API and the workers: every Redis key (keys.py) and every script lives in
this package, and nothing else writes Redis. A job's life, step by step:

1. placement.py  The API places a job in one script: idempotency claim, routing over fresh
                 heartbeats, admission by deadline, the job record, arq's job and its queue entry.
                 The arq job id is the job's placement ("<job id>.<n>", n = 1 at first).
2. arq           The worker (stock `arq.Worker`, worker/runner.py) runs the placement: the scripts that
                 queue, move and cancel placements publish "job <id>" / "abort <id>" on the queue's
                 wake channel, which the worker acts on at once (worker/wakeups.py, where every job is
                 claimed); its look at the queue and arq's poll of the abort set, both every
                 OPENJEV_WORKER_POLL_DELAY, are the fallback for a missed message.
3. records.py    The record's start (`record_start`, run by the worker's claim in claims.py) marks it
                 running only if the record still names its placement (and ends instead a sync job
                 whose API process is gone, presence.py); `store` keeps the outcome
                 only from that placement, once, and publishes "<job id> <status>"; the API's `cancel`
                 ends a job (one not yet started is taken off its queue, a running one gets a bounded
                 abort mark) and `collect` reads and removes a sync job's record at delivery.
4. membership.py Heartbeats (stamped with Redis's clock) say who is live and what it can take.
5. leases.py     Each worker holds a lease on its id. Once a lease lapses, live workers move that
                 worker's jobs as new placements; a worker that finds its lease lapsed takes a new
                 one and stops the jobs taken from it (worker/fencing.py). A worker's heartbeat,
                 lease renewal and look for vanished workers are one round trip a second (`beat`).

arq's own keys (a placement's job, its claim, its retry count, abort marks) are written by arq and, where
the scripts above must write them in the same step as the record, by the Lua functions of arq_layout.py.

The pub/sub notices (completion to the API, wake-ups to workers) only make things sooner: each
listener (subscriptions.py) resubscribes after a Redis error, and each has a polling fallback.

Every key has a TTL or a bound: records and arq's job keys expire after the deadline (plus the
result TTL for async jobs), sync records go at delivery, abort marks live only while a job could
still be running, and membership keys expire without heartbeats."""
