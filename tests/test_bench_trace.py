"""The queue-latency bench's MONITOR trace (bench/queue_latency.py): a job's events are read from the
commands Redis reported, by what each command is, whoever sent it."""

from __future__ import annotations

from bench.queue_latency import TRACE_STAGES, job_events

JOB = "job_01abc"
OTHER = "job_01xyz"
COMMANDS = [  # (time, client, command), as MONITOR reports them
    (10.0000, "127.0.0.1", f"EVALSHA aa 1 openjev:workers 5.0 hash rk {JOB}"),
    (10.0002, "lua", f"HSET openjev:job:{JOB} queue openjev:queue:w0"),
    (10.0004, "lua", f"PUBLISH openjev:queue:w0:wake job {JOB}.1"),
    (10.0005, "127.0.0.1", f"DEL openjev:job:{OTHER}"),  # the job before's record, dropped late
    (10.0010, "127.0.0.1", f"EVALSHA dd 1 openjev:queue:w0 {JOB}.1 w0/8c1f 1765000000000 640000"),
    (10.0011, "lua", f"GET arq:in-progress:{JOB}.1"),
    (10.0012, "lua", f"ZSCORE openjev:queue:w0 {JOB}.1"),
    (10.0013, "lua", f"SET arq:in-progress:{JOB}.1 w0/8c1f PX 640000"),
    (10.0014, "lua", f"HSET openjev:job:{JOB} status running"),
    (10.0016, "127.0.0.1", f"GET arq:job:{JOB}.1"),
    (10.0050, "127.0.0.1", f"EVALSHA cc 2 openjev:job:{JOB} openjev:done {JOB}.1 succeeded"),
    (10.0052, "lua", f"PUBLISH openjev:done {JOB} succeeded {{}}"),
    (10.0055, "127.0.0.1", f"ZREM openjev:queue:w0 {JOB}.1"),
]


def test_a_jobs_events_are_read_from_the_commands_that_name_it() -> None:
    events = job_events(JOB, COMMANDS)
    assert events == {"placed": 10.0, "woken": 10.0004, "claim": 10.0010, "claimed": 10.0013, "read": 10.0016,
                      "store": 10.0050, "notice": 10.0052}
    assert {event for _, event in TRACE_STAGES} == {*events, "answered"}  # every stage has its event


def test_a_job_the_trace_does_not_name_has_no_events() -> None:
    assert job_events(OTHER, COMMANDS[:3]) == {}
