"""Several ``distcheck run`` launches started at once, for a module whose tests each assert on one of them.

Beside CPU hogs the launches load each other as much as the hogs do, and the module waits for the
slowest launch, not for the sum of them (nor do the hogs run that long). Each launch gets its own
folder, its output in files (no pipe fills while another launch is waited for), one deadline for the
whole group, and is killed whole at that deadline; conftest's ``finish_process`` proves no process
of it survived.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import DistcheckRun, finish_process, kill_tree


def run_together(jobs: dict[str, list[str]], folder_for, timeout: float,
                 env: dict[str, dict[str, str]] | None = None) -> dict[str, DistcheckRun]:
    """``jobs``: name -> ``distcheck run`` arguments (``{tmp}`` in one stands for that launch's folder);
    ``folder_for(name)``: a new folder for it (``tmp_path_factory.mktemp``). Returns name -> the finished run,
    with --run-dir and --json added under its folder. ``env``: name -> variables that job's run gets on top of this
    process's environment."""
    started = {}
    try:
        for name, args in jobs.items():
            tmp = Path(folder_for(name))
            args = [a.format(tmp=tmp) for a in args]
            cut = args.index("--") if "--" in args else len(args)   # after '--' is the script's
            cmd = [sys.executable, "-m", "distcheck", "run", *args[:cut], "--run-dir", str(tmp / "run"),
                   "--json", str(tmp / "report.json"), *args[cut:]]
            out, err = open(tmp / "stdout", "w+"), open(tmp / "stderr", "w+")
            started[name] = (subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True,
                                              cwd=tmp, env={**os.environ, **(env or {}).get(name, {})}), tmp, out,
                             err)
        runs, deadline = {}, time.monotonic() + timeout
        for name, (proc, tmp, out, err) in started.items():
            finish_process(proc, str(tmp / "run"), max(1.0, deadline - time.monotonic()))
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
            runs[name] = DistcheckRun(subprocess.CompletedProcess(proc.args, proc.returncode, *texts), tmp / "run",
                                      tmp / "report.json")
        return runs
    finally:
        for proc, _, out, err in started.values():
            kill_tree(proc)
            out.close()
            err.close()
