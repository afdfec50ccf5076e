"""The harness the tests and the benchmarks share: real Redis servers, engines (the scripted one and the
reference CPU engine), workers and APIs, started as processes and stopped by pid, and the stacks built
from them. Not part of the product (the wheel ships api, common, worker and openjev only)."""
