"""The `openjev` command as a newcomer meets it: a version, help for every command and option, no
traceback when its reader stops early, and `calibrate`'s input format documented and its mistakes named
in one line. Real processes where the terminal is what is tested."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from common.calibration import Calibration
from harness.processes import ROOT
from openjev.cli import _parser


def openjev(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "openjev", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, **kwargs)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_prints_the_installed_version() -> None:
    done = openjev("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"openjev {version('openjev')}"


def test_every_command_and_option_has_help_text() -> None:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    described = {choice.dest: choice.help for choice in action._choices_actions}
    assert set(described) == set(subcommands())
    for name, parser in subcommands().items():
        assert described[name], name
        assert parser.description or name in ("serve", "smoke", "engine"), f"{name} has no description"
        for option in parser._actions:
            if option.help == argparse.SUPPRESS or isinstance(option, argparse._HelpAction):
                continue
            assert option.help, (name, option.option_strings or option.dest)


def test_worker_and_schema_help_say_what_they_do() -> None:
    assert "OPENJEV_ENGINE_URL" in openjev("worker", "--help").stdout
    assert "without loading a model" in openjev("schema", "--help").stdout


def test_schema_into_a_closed_pipe_exits_quietly() -> None:
    # `openjev schema | head`: the reader is gone before the schema is written (its end is closed first).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "openjev", "schema"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 0


def test_calibrate_documents_its_input_with_an_example_file_that_fits(tmp_path: Path) -> None:
    shown = openjev("calibrate", "--help").stdout
    assert '"probabilities"' in shown and "examples/calibration-records.jsonl" in shown
    out = tmp_path / "calibration.json"
    done = openjev("calibrate", "examples/calibration-records.jsonl", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert set(Calibration.load(out).temperatures) == {"noul", "choice", "score"}


@pytest.mark.parametrize(("name", "value", "says"), [
    ("OPENJEV_REDIS_MAXMEMORY", "lots", "should match pattern"),
    ("OPENJEV_REDIS_HEADROOM", "2", "less than 1"),
    ("OPENJEV_MAX_QUESTIONS", "many", "valid integer"),
])
def test_a_bad_setting_is_named_with_what_is_wrong_in_one_line(name: str, value: str, says: str) -> None:
    done = openjev("worker", env={**os.environ, name: value})
    assert done.returncode == 2
    assert done.stderr.startswith(f"openjev: {name}={value!r}: ") and says in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_calibrate_on_a_missing_file_says_so_in_one_line(tmp_path: Path) -> None:
    done = openjev("calibrate", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "c.json"))
    assert done.returncode == 2
    assert done.stderr == f"openjev calibrate: {tmp_path / 'nope.jsonl'}: cannot read it (No such file or directory)\n"


@pytest.mark.parametrize(("line", "says"), [
    ({"kind": "noul", "probabilities": {"true": 0.8, "false": 0.2}, "gold": "true"},
     '"probabilities" must be a list of numbers in [0, 1]'),
    ({"kind": "noul", "probabilities": [0.8, 0.2], "gold": "true"}, '"gold" must be the index of the right option'),
    ({"kind": "noul", "probabilities": [0.8, 0.2], "gold": 2}, '"gold" must be the index of the right option'),
    ({"kind": "yes", "probabilities": [0.8, 0.2], "gold": 0}, '"kind" must be "noul", "choice" or "score"'),
    ({"kind": "noul", "probabilities": [0.8, 0.2], "gold": 0, "question": {"type": "yes"}},
     '"question" is not a question'),
    ("not json", "not a JSON object"),
    ([0.8, 0.2], "expected an object like"),
])
def test_calibrate_names_the_bad_line_and_what_is_wrong_in_one_line(tmp_path: Path, line, says: str) -> None:
    records = tmp_path / "records.jsonl"
    good = {"kind": "noul", "probabilities": [0.6, 0.4], "gold": 0}
    records.write_text(json.dumps(good) + "\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    done = openjev("calibrate", str(records), "-o", str(tmp_path / "c.json"))
    assert done.returncode == 2
    assert done.stderr.startswith(f"openjev calibrate: {records}:2: ") and says in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
