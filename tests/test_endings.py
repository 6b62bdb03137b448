"""How a run ends, on its pure parts: the words every view uses, "nothing ran", exit codes, and
Ctrl-C during distcheck's start-up (a real process, no ranks)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

import pytest

from distcheck.diagnose.verdict import exit_code as _exit_code
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
                                            "completed", "ended at a certain hang", "ended by --stall-timeout",
                                            "ended by --busy-timeout", "nothing ran"}
    assert len({r.words for r in EndReason}) == len(EndReason)   # no two ends share a name


@pytest.mark.parametrize("end", [e for e in EndReason if e.abnormal and e is not EndReason.CRASH])
def test_every_view_names_an_end_the_same_way(end, tmp_path):
    """Terminal (line and summary), JSON, JUnit and ``distcheck runs`` all say ``EndReason.words``."""
    import json
    import xml.etree.ElementTree as ET

    from distcheck.files.saved_runs import summarize
    from distcheck.report import json_report, junit, runs_table

    observed = ("pass",) if end is EndReason.MAX_DURATION else ("hang",)
    result = _result(end_reason=str(end), observed=observed, ok=end is EndReason.MAX_DURATION)   # a script
    report = _report(result, interrupted=end is EndReason.INTERRUPTED)
    assert end.words in terminal.scenario_line(result).plain
    assert end.words in terminal.scenario_line(dataclasses.replace(result, script=False)).plain   # a scenario
    assert terminal.summary_line(report).plain.count(end.words) == 1
    saved = json.loads(json_report.render(report))
    assert saved["end_reason"] == saved["scenarios"][0]["end_reason"] == end.value
    xml = ET.fromstring(junit.render(report))
    assert {p.get("name"): p.get("value") for p in xml.iter("property")}["end_reason"] == end.words
    if not result.ok:
        [failed] = [e for case in xml.iter("testcase") for e in case if e.tag in ("failure", "error")]
        assert end.words in failed.text
    (tmp_path / "report.json").write_text(json.dumps(saved))
    assert runs_table.ended(summarize(tmp_path)) == end.words
    from distcheck.report import chrome_trace, html_timeline

    assert f"ended: {end.words}" in html_timeline.render(report, {})
    if end is not EndReason.MAX_DURATION:
        assert f"train.py: hang ({end.words})" in chrome_trace.render(report, {})


def test_a_script_is_judged_as_a_script_in_junit_too():
    """A script declared no expectation: its JUnit failure never says "expected pass, observed hang"."""
    import xml.etree.ElementTree as ET

    from distcheck.report import junit

    hung = _result(end_reason="certain_hang", observed=("hang",), ok=False)
    [failure] = ET.fromstring(junit.render(_report(hung))).iter("failure")
    assert failure.get("message").startswith("train.py: hang (ended at a certain hang): ")
    assert "expected" not in failure.get("message") and "expected" not in failure.text


def test_nothing_ran_is_an_error_in_junit():
    import xml.etree.ElementTree as ET

    from distcheck.report import junit

    report = _report(_result(skipped="needs at least 8 ranks; this run has 2", script=False, end_reason="nothing_ran"))
    suite = next(ET.fromstring(junit.render(report)).iter("testsuite"))
    assert suite.get("errors") == "1" and report.end_reason is EndReason.NOTHING_RAN


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
    # An ignored disposition survives exec: a parent that ignores SIGINT and execs the job, as a shell's '&' does
    # (preexec_fn would do it too, but is unsafe in a test process that has threads).
    ignoring = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])")
    done = subprocess.run([sys.executable, "-c", ignoring, code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130


def test_the_exit_site_of_a_sys_exit_is_the_user_line():
    from distcheck.rank.exit_site import exit_site

    try:
        sys.exit(0)
    except SystemExit as exc:
        where = exit_site(exc)
    assert where is not None and "test_endings.py:" in where and where.endswith("(sys.exit)")
    assert exit_site(SystemExit(0)) is None   # no traceback: nothing to say, and never an error


def test_messages_point_the_right_way(tmp_path):
    """No ranks start: a missing script, a script that does not parse, --nproc-per-node 0 and a torn
    report.json each get one line that says what happened, a hint, and the documented exit code."""
    import json

    def distcheck(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "distcheck", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    missing = distcheck("run", "jobs/train.py")
    assert missing.returncode == 2 and missing.stderr.splitlines()[0] == \
        "distcheck: error: jobs/train.py: no such file or directory", missing.stderr
    assert "built-in scenarios:" not in missing.stderr
    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo'\n")
    broken = distcheck("run", "train.py")
    assert broken.returncode == 2 and "train.py:2: syntax error in your script: dist.init_process_group('gloo'" \
        in broken.stderr.splitlines()[0], broken.stderr
    none = distcheck("run", "collectives_sanity", "--nproc-per-node", "0")
    assert none.returncode == 2 and "hint: give the number of ranks to start" in none.stderr, none.stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps({"schema": "distcheck.report/1"})[:20])
    torn = distcheck("report", str(run_dir))
    assert torn.returncode == 5 and f"'distcheck analyze {run_dir}'" in torn.stderr, torn.stderr
    assert "Traceback" not in missing.stderr + broken.stderr + none.stderr + torn.stderr
