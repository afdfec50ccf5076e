"""The README's request path (section "What happens to a request") is the code's: a sync request goes
from its route to the engine call through the product files it names, at most eight, each handing the
request to the next by a real import (or, between the API and the worker, through the queue)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def request_path() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What happens to a request", 1)[1]
    paragraph = section.split("In more detail:", 1)[0]
    return re.findall(r"`([a-z_/]+\.py)`", paragraph)


def imported_modules(path: str) -> set[str]:
    """The product modules `path` imports (dotted names)."""
    tree = ast.parse((ROOT / path).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_the_request_path_is_eight_files_that_exist() -> None:
    files = request_path()
    assert files[0] == "api/routes.py" and files[-1] == "worker/engine_client.py", files
    assert len(files) == len(set(files)) <= 8, files
    for path in files:
        assert (ROOT / path).is_file(), f"the README names {path}, which is not in the repo"


def test_each_file_on_the_path_is_reached_from_the_one_that_uses_it() -> None:
    files = set(request_path())
    # Who calls whom on the way: the route prepares the job and submits it; preparation compiles the prompt;
    # the queue client places it (one script); the worker's arq function (registered by worker/runner.py)
    # starts and stores through the job record's owner and calls the engine.
    calls = {"api/routes.py": ["api/preparation.py", "api/queue_client.py"],
             "api/preparation.py": ["common/prompt.py"],
             "api/queue_client.py": ["common/queue/placement.py"],
             "worker/runner.py": ["worker/evaluation.py"],
             "worker/evaluation.py": ["common/queue/records.py", "worker/engine_client.py"]}
    for caller, callees in calls.items():
        imported = imported_modules(caller)
        for callee in callees:
            assert callee in files or caller not in files, f"{callee} is on the path but the README leaves it out"
            assert module(callee) in imported, f"{caller} no longer imports {callee}: the README's path is stale"
    # The job function arq runs is the one on the path.
    runner = (ROOT / "worker/runner.py").read_text()
    assert re.search(r"func\(evaluate, name=keys\.JOB_FUNCTION\)", runner)
    assert "async def evaluate(" in (ROOT / "worker/evaluation.py").read_text()
