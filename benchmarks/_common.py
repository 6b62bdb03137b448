"""Small helpers shared by the benchmark scripts (not part of distcheck)."""

from __future__ import annotations

import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def python() -> str:
    return sys.executable
