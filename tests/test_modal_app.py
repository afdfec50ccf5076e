"""The Modal app, checked offline: defining it contacts nothing, so the test reads the decorators'
arguments from the source, evaluates them in the module, and runs the helpers the container runs."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.settings import Settings
from harness.processes import ROOT

modal = pytest.importorskip("modal", reason="the Modal client is a dev dependency")
import modal_app  # noqa: E402  (needs modal, checked just above)

SOURCE = ast.parse((ROOT / "modal_app.py").read_text())


def function_def(name: str) -> ast.FunctionDef:
    return next(node for node in SOURCE.body if isinstance(node, ast.FunctionDef) and node.name == name)


def decorator(function: str, name: str) -> tuple[list[Any], dict[str, Any]]:
    """The evaluated positional and keyword arguments of decorator `name` (e.g. "app.function") on `function`."""
    for node in function_def(function).decorator_list:
        if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
            namespace = vars(modal_app)
            args = [eval(ast.unparse(arg), namespace) for arg in node.args]
            kwargs = {kw.arg: eval(ast.unparse(kw.value), namespace) for kw in node.keywords if kw.arg}
            return args, kwargs
    raise AssertionError(f"{function} has no @{name}(...)")


def calls_in(function: str) -> list[str]:
    return [ast.unparse(node.func) for node in ast.walk(function_def(function)) if isinstance(node, ast.Call)]


def test_replicas_run_on_one_b200_each() -> None:
    _, options = decorator("serve", "app.function")
    assert options["gpu"] == "B200"
    assert modal_app.serve._spec_.gpus == "B200"  # what Modal itself recorded


def test_the_huggingface_volume_holds_weights_and_compile_caches() -> None:
    _, options = decorator("serve", "app.function")
    assert options["volumes"] == {modal_app.CACHE_MOUNT: modal_app.hf_volume}
    volume_call = next(node for node in ast.walk(SOURCE) if isinstance(node, ast.Call)
                       and ast.unparse(node.func) == "modal.Volume.from_name")
    assert eval(ast.unparse(volume_call.args[0]), vars(modal_app)) == "openjev-huggingface"
    env = modal_app.IMAGE_ENV
    for name in ("HF_HOME", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR", "OPENJEV_CACHE_DIR"):
        assert env[name].startswith(modal_app.CACHE_MOUNT + "/"), name


def test_startup_is_long_enough_for_a_first_download_and_graph_capture() -> None:
    _, options = decorator("serve", "app.function")
    (port,), web = decorator("serve", "modal.web_server")
    assert options["startup_timeout"] >= 30 * 60 and web["startup_timeout"] >= 30 * 60
    assert port == modal_app.API_PORT
    assert options["timeout"] > Settings(_env_file=None).request_timeout  # type: ignore[call-arg]


def test_replicas_scale_to_zero_after_five_idle_minutes() -> None:
    _, options = decorator("serve", "app.function")
    assert options["scaledown_window"] == 300
    assert options["min_containers"] == 0
    _, concurrency = decorator("serve", "modal.concurrent")
    assert concurrency["max_inputs"] > concurrency["target_inputs"] > 0


def test_only_frontend_and_served_name_are_forwarded_from_the_deploying_shell() -> None:
    assert modal_app.FORWARDED_ENV == ("OPENJEV_FRONTEND", "OPENJEV_SERVED_MODEL_NAME")
    shell = {"OPENJEV_FRONTEND": "python", "OPENJEV_SERVED_MODEL_NAME": "m",
             "OPENJEV_API_KEY": "never-forwarded", "HOME": "/root"}
    assert modal_app.forwarded_env(shell) == {"OPENJEV_FRONTEND": "python", "OPENJEV_SERVED_MODEL_NAME": "m"}
    assert modal_app.forwarded_env({}) == {}
    assert "forwarded_env(os.environ)" in ast.unparse(function_def("serve").decorator_list[0])


def test_secrets_are_opt_in_by_name() -> None:
    assert modal_app.deployment_secrets({}) == []
    secrets = modal_app.deployment_secrets({"OPENJEV_MODAL_SECRETS": "openjev-redis, huggingface"})
    assert len(secrets) == 2


def test_the_container_runs_openjev_serve_launching_the_images_sglang() -> None:
    assert modal_app.serve_command({}) == [
        "/opt/openjev/bin/openjev", "serve", "--host", "0.0.0.0", "--port", "8000",
        "--sglang-python", "/usr/bin/python3"]
    assert "Popen" in " ".join(calls_in("serve")) and "serve_command" in calls_in("serve")


def test_extra_sglang_arguments_pass_through_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modal_app, "SGLANG_ARGS", ("--mem-fraction-static", "0.85"))
    assert modal_app.serve_command({})[-3:] == ["--", "--mem-fraction-static", "0.85"]


def test_a_redis_url_from_a_secret_makes_replicas_share_it() -> None:
    argv = modal_app.serve_command({"OPENJEV_REDIS_URL": "rediss://:pw@redis.example:6380/0"})
    assert argv[-1] == "--shared-redis"
    assert not [arg for arg in argv if "pw" in arg]  # the URL stays in the environment, off the process list


def test_the_image_is_a_pinned_supported_sglang_with_openjev_in_its_own_environment() -> None:
    match = re.fullmatch(r"lmsysorg/sglang:v(\d+\.\d+\.\d+)-cu\d+(-runtime)?", modal_app.SGLANG_IMAGE)
    assert match and match.group(1) == modal_app.SGLANG_VERSION
    assert (0, 5, 19) <= tuple(int(p) for p in modal_app.SGLANG_VERSION.split(".")) <= (0, 5, 23)
    assert modal_app.IMAGE_ENV["OPENJEV_SGLANG_VERSION"] == modal_app.SGLANG_VERSION
    assert modal_app.serve_command({})[0].startswith(modal_app.OPENJEV_VENV + "/")
    packages = ast.literal_eval(ast.unparse(next(
        node.value for node in SOURCE.body if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "OPENJEV_PACKAGES")))
    assert set(packages) == {"api", "common", "worker", "openjev"}  # the wheel's packages, from pyproject


def test_the_container_ends_when_the_stack_does() -> None:
    ended: list[int] = []
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    modal_app.exit_with(failing, ended.append)
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    modal_app.exit_with(killed, ended.append)
    assert ended == [3, 137]


def test_modal_run_smoke_tests_the_ephemeral_server_and_fails_with_it() -> None:
    assert any(ast.unparse(d) == "app.local_entrypoint()" for d in function_def("main").decorator_list)
    calls = calls_in("main")
    assert "run_smoke" in calls and "serve.get_web_url" in calls and "sys.exit" in calls
    smoke_call = next(node for node in ast.walk(function_def("main"))
                      if isinstance(node, ast.Call) and ast.unparse(node.func) == "run_smoke")
    assert {kw.arg for kw in smoke_call.keywords} >= {"key_env", "allow_weak_model", "out", "startup_timeout"}


def test_defining_the_app_needs_no_network() -> None:
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("no network namespaces here (unshare -n needs root or user namespaces)")
    probe = "import modal_app; assert modal_app.app.name == 'openjev'"
    done = subprocess.run([unshare, "-n", sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_module_imports_only_modal_and_the_standard_library_at_top_level() -> None:
    # The container imports this file with the SGLang image's Python, where openjev is not installed.
    imported = {alias.name.split(".")[0] for node in SOURCE.body if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == {"modal"}
    assert Path(modal_app.__file__).resolve() == ROOT / "modal_app.py"


def test_each_replicas_own_redis_keeps_its_data_on_the_container_disk_not_the_shared_volume() -> None:
    redis_dir = modal_app.IMAGE_ENV["OPENJEV_REDIS_DIR"]
    assert redis_dir == modal_app.REDIS_DIR and Path(redis_dir).is_absolute()
    assert not redis_dir.startswith(modal_app.CACHE_MOUNT + "/")  # every replica mounts the Volume
    assert Settings(_env_file=None, redis_dir=redis_dir).embedded_redis_dir == Path(redis_dir)  # type: ignore[call-arg]


def test_a_shared_redis_url_without_a_password_stops_the_replica_with_a_message(tmp_path: Path) -> None:
    env = {"OPENJEV_REDIS_URL": "redis://redis.example:6379/0"}  # as a Secret without credentials gives it
    argv = modal_app.serve_command(env)
    assert argv[0] == f"{modal_app.OPENJEV_VENV}/bin/openjev"
    local = [sys.executable, "-m", "openjev", *argv[1:]]  # this checkout's openjev in place of the image's
    done = subprocess.run(local, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})
    assert done.returncode != 0
    assert "OPENJEV_REDIS_URL has no password" in done.stderr
