"""Small helpers shared by the benchmark scripts (not part of distcheck)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [title] if title else []
    for k, r in enumerate(cells):
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def conditions() -> str:
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    import torch

    return (f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
            f"load average {load}, {time.strftime('%Y-%m-%d %H:%M')}")


def run_group(cmds: list[list[str]], envs: list[dict], timeout: float, cwd: Path | None = None
              ) -> list[subprocess.CompletedProcess]:
    """Start processes in their own session; kill every process group on timeout or error. ``cwd``: where
    they run (a checkout's own folder would come first on ``sys.path`` for ``python -m``, before PYTHONPATH)."""
    procs = [subprocess.Popen(c, env={**os.environ, **e}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=cwd) for c, e in zip(cmds, envs)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            if p.poll() is None:
                p.wait()
    return results


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant, whatever session it runs in (torch's
    launcher starts each rank in a session of its own, out of reach of a ``killpg`` of the launcher's), then
    reap ``proc``."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for child in tree:
        try:
            child.kill()
        except psutil.Error:
            pass
    proc.wait()


def python() -> str:
    return sys.executable


# -- the tiny configuration and the output check, one for every benchmark ----------------------------------

TINY_HELP = ("the smallest configuration, in seconds: the benchmark's real code path end to end, its output "
             "checked (tests/test_benchmarks.py runs it; explicit options still win)")
NOT_WELL_FORMED = 3   # the exit code of a run whose figures are not numbers or whose planted fault was missed
WELL_FORMED = "well formed: "


def parse_args(parser: argparse.ArgumentParser, tiny: Mapping[str, Any]) -> argparse.Namespace:
    """``parser``'s arguments and ``--tiny``, which makes each of ``tiny`` (option dest -> value) the default:
    the smallest sizes that still run the real code path. Options given on the command line win over it."""
    parser.add_argument("--tiny", action="store_true", help=TINY_HELP)
    args = parser.parse_args()
    if args.tiny:
        unknown = sorted(set(tiny) - set(vars(args)))
        if unknown:   # a tiny setting for an option that is gone: the configuration drifted from the script
            raise SystemExit(f"--tiny sets options this benchmark does not have: {', '.join(unknown)}")
        parser.set_defaults(**tiny)
        args = parser.parse_args()
    return args


def well_formed(figures: Mapping[str, Any], found: Mapping[str, bool] | None = None) -> None:
    """The benchmark's own check of what it measured, before anyone reads it: every figure a finite number
    (or a list or dict of them), every planted fault ``found`` (true). Prints one line, ``well formed:`` and
    the figures as JSON (tests/test_benchmarks.py reads it); a failed check ends the run with
    ``NOT_WELL_FORMED``, naming each failure."""
    found = dict(found or {})
    bad = [f"{name} is {value!r}, not a number" for name, value in figures.items() if not _numbers(value)]
    bad += [f"{name}: no" for name, ok in found.items() if ok is not True]
    if not figures:
        bad.append("no figure measured")
    if bad:
        print(f"not well formed: {'; '.join(bad)}", flush=True)
        raise SystemExit(NOT_WELL_FORMED)
    print(WELL_FORMED + json.dumps({"figures": dict(figures), "found": found}), flush=True)


def _numbers(value: Any) -> bool:
    if isinstance(value, bool):   # a bool is an int to Python, but no measurement
        return False
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return bool(value) and all(_numbers(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_numbers(v) for v in value)
    return False
