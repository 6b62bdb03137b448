"""Static checks in the quick lane (issue 56, item 10): ruff and mypy on ``distcheck/``, with the project's own
configuration (``[tool.ruff]``, ``[tool.mypy]`` in pyproject.toml), both clean.

Each runs as a subprocess from the repository root, as a person would run it (``ruff check distcheck/``,
``mypy``); a tool that is not installed skips its test with the command that installs it (``pip install
-e '.[test]'`` brings both). mypy keeps its incremental cache in ``.mypy_cache/`` (git ignores it): cold, on a
fresh checkout, it takes about 20-45 s of wall time on two busy cores, warm about 2-5 s. tests/conftest.py hands
these tests out first, to one worker, so that a cold mypy overlaps the rest of the lane instead of ending it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed here (pip install -e '.[test]' installs it)")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    return done, time.monotonic() - started


def test_ruff_is_clean_on_distcheck():
    done, took = _run("ruff", "check", "--no-cache", "distcheck/", timeout_s=120)
    assert done.returncode == 0, f"ruff check distcheck/ ({took:.1f} s):\n{done.stdout}{done.stderr}"


def test_mypy_is_clean_on_distcheck():
    # the files, the Python version and the per-module settings are [tool.mypy]'s
    done, took = _run("mypy", timeout_s=280)
    assert done.returncode == 0, f"mypy ({took:.1f} s):\n{done.stdout[-8000:]}{done.stderr[-2000:]}"
    assert "Success: no issues found" in done.stdout, done.stdout
