"""Every test runs somewhere in CI: the lanes the default ``pytest`` leaves out (pyproject.toml's ``addopts``) are
each run by ``.ci/run``, and the README's test command is the one ``.ci/run`` calls. Pure: reads the two files."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _left_out_of_the_default_run() -> set[str]:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    args = shlex.split(addopts)
    expression = args[args.index("-m") + 1]
    return set(re.findall(r"not (\w+)", expression))


def _ci_commands() -> list[list[str]]:
    """``.ci/run``'s own pytest and pip lines, as words."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith(("pytest", "pip "))]


def _ci_lanes() -> set[str]:
    lanes: set[str] = set()
    for words in _ci_commands():
        if words[:2] == ["pytest", "-m"]:
            lanes |= set(re.findall(r"\w+", words[2])) - {"or", "and", "not"}
    return lanes


def test_every_lane_left_out_of_the_default_run_is_run_by_ci():
    left_out = _left_out_of_the_default_run()
    assert {"public", "determinism", "ecosystem"} <= left_out, left_out
    assert left_out <= _ci_lanes(), sorted(left_out - _ci_lanes())


def test_every_lane_marker_is_declared():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    declared = {m.split(":")[0] for m in markers}
    assert _left_out_of_the_default_run() <= declared


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e '.[test]' && pytest\n" in readme
    ci = _ci_commands()
    assert ["pip", "install", "torch==2.13.0", "-e", ".[test]"] in ci and ["pytest"] in ci
