"""arq is used as its authors meant: no subclass of its Worker, no override of its methods, no
`_`-prefixed arq name anywhere in the project; and since the queue writes arq's job layout itself
(common/queue/placement.py) and worker/wakeups.py starts jobs through `Worker.run_job`, arq is pinned
exactly and the installed release is checked to read what the queue writes and to have what the claims drive."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("api", "common", "worker", "openjev", "bench", "tests", "harness")
           for p in (ROOT / d).rglob("*.py")]


def arq_names(tree: ast.Module) -> set[str]:
    """Local names bound to arq modules or objects by this module's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "arq":
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "arq"}
    return names


def test_no_class_in_the_project_subclasses_an_arq_class() -> None:
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        imported = arq_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split(".")[0] for b in node.bases}
                if bases & (imported | {"arq"}):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert offenders == []


def arq_private_names() -> set[str]:
    """`_`-prefixed names of arq's modules and of the objects arq hands out (Worker, ArqRedis, Job)."""
    import arq.connections
    import arq.jobs
    import arq.worker

    owners = (arq.worker, arq.connections, arq.jobs, arq.worker.Worker, arq.connections.ArqRedis, arq.jobs.Job)
    return {n for owner in owners for n in dir(owner) if n.startswith("_") and not n.startswith("__")}


def defined_here(tree: ast.Module) -> set[str]:
    """Names this module defines itself (its own private helpers and attributes)."""
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    return names


def test_no_underscore_name_of_arq_is_imported_or_used() -> None:
    private = arq_private_names()
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        foreign = private - defined_here(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "arq":
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                              if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr in foreign:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def test_arq_and_uvicorn_are_pinned_exactly_to_the_installed_releases() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name in ("arq", "uvicorn"):
        [requirement] = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == name]
        assert [s.operator for s in requirement.specifier] == ["=="], requirement  # a new release is a reviewed bump
        assert requirement.specifier.contains(version(name))


def test_uv_lock_is_committed_and_installed_with_relative_sources_only() -> None:
    """uv.lock pins what every install gets (README "Installs are locked"): the lock is checked in, the
    environment the tests run in holds its releases, and no source in it names a folder of one machine."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked = {}
    for package in lock["package"]:
        locked.setdefault(package["name"], set()).add(package["version"])
        source = package.get("source", {})
        for kind in ("registry", "path", "directory", "editable"):
            where = source.get(kind, "")
            assert not where.startswith("/") and not where.startswith("file:"), (package["name"], source)
    for name in ("arq", "uvicorn", "fastapi", "redis", "httpx", "pydantic", "transformers", "torch"):
        assert version(name) in locked[name], (name, version(name), locked[name])
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "uv.lock" not in gitignore


async def test_the_installed_arq_reads_the_job_layout_the_queue_writes(redis) -> None:
    """A job placed by the queue's own script is, to arq's public reader, a queued job of the evaluate
    function with the job as its one argument, under the placement's arq job id."""
    import time

    import orjson
    from arq.connections import ArqRedis
    from arq.jobs import serialize_job

    from common.jobs import deserialize, serialize
    from common.queue import keys
    from common.queue.membership import WorkerInfo, heartbeat
    from common.queue.placement import Dispatcher
    from common.settings import RoutingPolicy

    queue = keys.queue_name("layout")
    await heartbeat(redis, WorkerInfo(id="layout", queue=queue, model="m", max_jobs=1, max_branches=1,
                                      started_at=time.time()))
    payload = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(b'{"id": "job_layout"}'),), {}, None, 123,
                            serializer=serialize)
    placed = await Dispatcher(redis, 1.25, RoutingPolicy.hash).place("job_layout", "k", 30.0, {"status": "queued"},
                                                                      60, payload)
    assert placed.queue == queue
    arq = ArqRedis(redis.connection_pool, job_deserializer=deserialize)
    [job] = await arq.queued_jobs(queue_name=queue)
    assert job.function == keys.JOB_FUNCTION and list(job.args) == [{"id": "job_layout"}] and job.kwargs == {}
    assert job.job_id == keys.placement_id("job_layout", 1) and job.job_try is None
    assert job.score is not None and job.score < time.time() * 1000  # due at once on any worker's clock


def test_arqs_start_log_names_the_job_without_its_prompt() -> None:
    """arq formats a job's arguments for its start log line (`args_to_string`) whether or not the line is
    logged: the job the worker's deserializer hands it reads as its id, never as its token ids."""
    import orjson
    from arq.jobs import deserialize_job_raw, serialize_job
    from arq.utils import args_to_string

    from common.jobs import deserialize, serialize
    from common.queue import keys

    job = {"id": "job_logged", "prefix_ids": [9911, 9922, 9933], "branches": [{"suffix_ids": [9944]}]}
    raw = serialize_job(keys.JOB_FUNCTION, (orjson.Fragment(orjson.dumps(job)),), {}, None, 123, serializer=serialize)
    function, args, kwargs, _, _ = deserialize_job_raw(raw, deserializer=deserialize)
    assert function == keys.JOB_FUNCTION and args == [job] and kwargs == {}  # the same job, as a dict
    line = args_to_string(args, kwargs)
    assert "job_logged" in line and not any(str(n) in line for n in (9911, 9922, 9933, 9944)), line


def test_arq_keys_are_written_only_through_arq_layout() -> None:
    """One owner of arq's layout: no product module but common/queue/keys.py (the names) and
    common/queue/arq_layout.py (the Lua functions every script includes) names arq's keys, and each script
    that claims a placement, writes it, moves it, reruns it, resumes it or aborts it includes those functions."""
    names = ("ARQ_JOB", "ARQ_IN_PROGRESS", "ARQ_RETRY", "ARQ_ABORTS", "job_key_prefix", "in_progress_key_prefix",
             "retry_key_prefix", "abort_jobs_ss", "arq:job:", "arq:in-progress:", "arq:retry:", "arq:abort")
    owners = {ROOT / "common" / "queue" / "keys.py", ROOT / "common" / "queue" / "arq_layout.py"}
    for path in (p for d in ("api", "common", "worker", "openjev") for p in (ROOT / d).rglob("*.py")):
        if path not in owners:
            text = path.read_text()
            assert not [n for n in names if n in text], f"{path.relative_to(ROOT)} names arq's keys"
    from common.queue import claims, leases, placement, records, reruns
    from common.queue.arq_layout import ARQ_LUA

    for script in (claims._CLAIM, placement._SUBMIT, leases._MOVE, leases._RESUME, reruns._RERUN, records._CANCEL):
        assert script.startswith(ARQ_LUA)


def test_the_worker_attributes_the_claims_drive_are_arqs_public_ones() -> None:
    """worker/wakeups.py does what arq's `start_jobs` does after its claim: counts the job in
    `job_counter`, runs it in `run_job` and keeps its task in `tasks`; it reads `max_jobs`,
    `queue_read_limit` and `in_progress_timeout_s`, and turns `allow_pick_jobs` off. The pinned release
    has them all, public."""
    import inspect

    from arq import Worker
    from arq.worker import func

    async def noop(ctx: dict) -> None:
        return None

    worker = Worker(functions=[func(noop, name="noop")], max_jobs=3, queue_read_limit=7)
    assert inspect.iscoroutinefunction(worker.run_job)
    assert list(inspect.signature(worker.run_job).parameters) == ["job_id", "score"]
    assert (worker.job_counter, worker.max_jobs, worker.queue_read_limit, worker.tasks) == (0, 3, 7, {})
    assert worker.in_progress_timeout_s == 300 + 10  # arq's default job timeout, and its margin
    assert worker.allow_pick_jobs is True  # what the claims turn off
