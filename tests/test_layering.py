"""The layering ARCHITECTURE.md draws, enforced with import-linter's contracts (pyproject.toml's
[tool.importlinter]): no layer imports a higher one, no import cycle inside any folder; and the
house rules a reader relies on: few flat modules, short modules and functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distcheck"
MAX_FLAT_MODULES = 10        # besides __init__ and __main__
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60      # a function's body


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "builtin_scenarios" not in p.parts)


def test_the_import_contracts_hold():
    pytest.importorskip("importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    done = subprocess.run([*command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_few_modules_sit_flat_at_the_top():
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(flat) <= MAX_FLAT_MODULES, flat


def test_no_module_or_function_is_too_long_to_read():
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.[ch]")):   # the tracer's hot path in C: its files too
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # its body: a typer command declares one option a line in its signature
                lines = node.end_lineno - node.body[0].lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_modules and not long_functions, long_modules + long_functions
