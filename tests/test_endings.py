"""How a run ends, on its pure parts: the words every view uses, "nothing ran", exit codes, and
Ctrl-C during distcheck's start-up (a real process, no ranks)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

from distcheck.cli import _exit_code
from distcheck.errors import ExitCode
from distcheck.models import EndReason, Report, RunInfo, ScenarioResult
from distcheck.report import terminal


def _result(**kw) -> ScenarioResult:
    base = dict(name="train", source="/u/train.py", expected=("pass",), observed=("pass",), ok=True,
                duration_s=1.0, script=True, end_reason="completed")
    return ScenarioResult(**{**base, **kw})


def _report(*scenarios: ScenarioResult, interrupted: bool = False) -> Report:
    run = RunInfo(backend="gloo", world_size=2, nnodes=1, nproc_per_node=2, torch_version="2", distcheck_version="0",
                  command="distcheck run", run_dir="/tmp/r", seed=0, duration_s=1.0, started_at="", hostname="h",
                  python_version="3", versions={})
    return Report(run=run, scenarios=scenarios, interrupted=interrupted)


def test_every_end_reason_has_words():
    assert {r.words for r in EndReason} >= {"interrupted", "ended by --timeout", "ended by --max-duration",
                                            "completed"}


def test_only_skipped_targets_is_nothing_ran_not_a_pass():
    report = _report(_result(skipped="needs at least 8 ranks; this run has 2", script=False))
    assert report.nothing_ran and report.verdict == "fail"
    assert _exit_code(report) is ExitCode.NOTHING_RAN and int(ExitCode.NOTHING_RAN) == 6
    assert terminal.summary_line(report).plain.startswith("NOTHING RAN")


def test_an_interrupted_script_never_ran_clean():
    cut = _result(end_reason="interrupted", ok=False)
    assert "ran clean" not in terminal.scenario_line(cut).plain
    assert "interrupted" in terminal.scenario_line(cut).plain
    assert _exit_code(_report(cut, interrupted=True)) is ExitCode.INTERRUPTED


def test_a_timeout_says_so():
    hung = _result(end_reason="timeout", observed=("hang",), ok=False)
    assert "ended by --timeout" in terminal.scenario_line(hung).plain
    assert "ended by --timeout" in terminal.summary_line(_report(hung)).plain
    assert _exit_code(_report(hung)) is ExitCode.TIMEOUT
    clean = dataclasses.replace(hung, observed=("pass",))
    assert "ran clean" not in terminal.scenario_line(clean).plain


def test_ctrl_c_during_start_up_is_exit_130_without_a_traceback():
    """The handler is installed on distcheck's first line: a SIGINT while it imports ends it at once."""
    code = ("import os, signal; from distcheck import interrupt; interrupt.install(); "
            "os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(30)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert "interrupted" in done.stderr and "nothing ran" in done.stderr


def test_an_inherited_ignored_sigint_is_still_honoured():
    """A job started with '&' from a script ignores SIGINT; distcheck's handler replaces that."""
    code = ("import os, signal, time; from distcheck import interrupt; interrupt.install(); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 130


def test_the_exit_site_of_a_sys_exit_is_the_user_line():
    from distcheck.rank.exit_site import exit_site

    try:
        sys.exit(0)
    except SystemExit as exc:
        where = exit_site(exc)
    assert where is not None and "test_endings.py:" in where and where.endswith("(sys.exit)")
    assert exit_site(SystemExit(0)) is None   # no traceback: nothing to say, and never an error
