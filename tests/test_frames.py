"""distcheck's own frames are left out of the tracebacks and log tails it shows (report/frames.py)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

import distcheck
from distcheck.models import Report, RunInfo, ScenarioResult
from distcheck.report import junit, terminal
from distcheck.report.frames import is_own_frame, without_own_frames

PKG = Path(distcheck.__file__).resolve().parent
TORCH = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
# what a rank that ran into a gloo error under `distcheck run` leaves in its log (shape of a real one)
RANK_LOG = f'''Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{PKG}/rank/worker.py", line 457, in main
    results = run_scenarios(args, rank, world, local_rank, tracer)
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/home/u/train.py", line 19, in step
    dist.all_reduce(t)
  File "{PKG}/rank/tracer.py", line 265, in traced
    result = original(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{TORCH}", line 3252, in all_reduce
    work.wait()
RuntimeError: Connection closed by peer'''


def test_distcheck_and_runpy_frames_are_left_out_and_the_users_and_torchs_kept():
    shown = without_own_frames(RANK_LOG)
    assert shown.splitlines() == [
        "Traceback (most recent call last):",
        '  File "/home/u/train.py", line 19, in step',
        "    dist.all_reduce(t)",
        f'  File "{TORCH}", line 3252, in all_reduce',
        "    work.wait()",
        "RuntimeError: Connection closed by peer",
    ]


def test_a_rank_prefixed_traceback_is_filtered_line_by_line():
    prefixed = "\n".join(f"[rank1]:{line}" for line in RANK_LOG.splitlines())
    shown = without_own_frames(prefixed)
    assert "worker.py" not in shown and "tracer.py" not in shown and "runpy" not in shown
    assert "[rank1]:    dist.all_reduce(t)" in shown and "[rank1]:RuntimeError: Connection closed by peer" in shown


def test_what_counts_as_distchecks_own():
    assert is_own_frame(f"{PKG}/pytest/plugin.py") and is_own_frame("/venv/lib/site-packages/distcheck/cli.py")
    assert not is_own_frame(f"{PKG}/builtin_scenarios/rank_raises_mid_loop.py")   # the user's reading
    assert not is_own_frame("/home/u/distcheck/train.py")    # a user's folder of that name
    assert without_own_frames("no traceback here\n  indented") == "no traceback here\n  indented"


def test_the_terminal_and_junit_show_the_tail_without_distchecks_frames():
    result = ScenarioResult(name="train", source="/home/u/train.py", expected=("pass",), observed=("crash",),
                            ok=False, duration_s=1.0, log_tail=RANK_LOG, script=True)
    run = RunInfo(backend="gloo", world_size=2, nnodes=1, nproc_per_node=2, torch_version="2.13.0+cpu",
                  distcheck_version="0", command="distcheck run train.py", run_dir="/tmp/run", seed=0,
                  duration_s=1.0, started_at="2026-01-01T00:00:00")
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(terminal.scenario_block(result))
    for shown in (console.file.getvalue(), junit.render(Report(run=run, scenarios=(result,)))):
        assert 'train.py", line 19' in shown and "RuntimeError: Connection closed by peer" in shown
        assert "tracer.py" not in shown and "worker.py" not in shown and "runpy" not in shown
