"""How a run ends, on real gloo ranks: Ctrl-C at any moment (while distcheck imports, while the ranks
start, mid-hang), SIGTERM, each within 2 s, exit 130, no traceback, nothing left running.

distcheck runs in a session of its own and the signal goes to that whole process group, as a
terminal's Ctrl-C does. Every signal is sent on evidence of the moment, never after a sleep."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, kill_tree, run_distcheck, survivors, wait_for

pytestmark = pytest.mark.e2e

SCRIPTS = REPO / "tests" / "scripts" / "endings"
STUCK = SCRIPTS / "stuck_on_event.py"
WAIT_LINE = f"stuck_on_event.py:{next(i for i, line in enumerate(STUCK.read_text().splitlines(), 1) if '.wait()' in line)}"
ARGS = ["--nproc-per-node", "3", "--stall-timeout", "120", "--timeout", "90"]
ENDED_WITHIN_S = 2.0


@pytest.fixture(autouse=True)
def _no_orphan():
    """A test that fails before its signal still ends the distcheck it started (its pipe unread, the
    live view would block on it)."""
    started.clear()
    yield
    for proc in started:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate()


started: list[subprocess.Popen] = []


def start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "distcheck", "run", str(STUCK), *ARGS, *extra, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=tmp_path)
    started.append(proc)
    return proc, run_dir


def signal_and_finish(proc: subprocess.Popen, run_dir: Path, sig: int, group: bool = True) -> tuple[str, float]:
    """Send ``sig`` (to the whole group, as a terminal does); the output and seconds until distcheck exited."""
    sent = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"distcheck did not end 30 s after the signal:\n{out[-3000:]}")
    took = time.monotonic() - sent
    kill_tree(proc)
    gone = wait_for(lambda: not survivors(str(run_dir), proc.pid), timeout=10)
    assert gone, f"left running: {[p.info['cmdline'] for p in survivors(str(run_dir), proc.pid)]}"
    return out, took


def assert_interrupted(out: str, took: float, proc: subprocess.Popen) -> None:
    assert proc.returncode == 130, out[-3000:]
    assert took <= ENDED_WITHIN_S, f"ended {took:.2f} s after the signal\n{out[-3000:]}"
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "Fatal Python error" not in out, out
    assert "interrupted" in out, out
    assert "ran clean" not in out, out


def report_exit(run_dir: Path) -> int:
    return run_distcheck(["report", str(run_dir)], run_dir.parent, run_dir, timeout=60).returncode


def status_files(run_dir: Path) -> list[Path]:
    return list(run_dir.glob("*/status/rank*.json"))


def torch_loaded(pid: int) -> bool:
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def waiting_in_all_reduce(run_dir: Path, ranks: tuple[int, ...]) -> bool:
    from distcheck.files.trace_tail import TraceTail

    traces = [run_dir / "stuck_on_event" / "traces" / f"rank{r}.trace" for r in ranks]
    return all(t.exists() and TraceTail(t).read().newest_open is not None for t in traces)


def test_ctrl_c_while_distcheck_still_imports_ends_at_once(tmp_path):
    proc, run_dir = start(tmp_path)
    # distcheck is importing torch (its library is mapped), and no launch has begun
    assert wait_for(lambda: torch_loaded(proc.pid) or proc.poll() is not None, timeout=60, poll=0.005)
    assert not (run_dir / "stuck_on_event").exists(), "too late: the launch had begun"
    out, took = signal_and_finish(proc, run_dir, signal.SIGINT)
    assert_interrupted(out, took, proc)
    assert not status_files(run_dir)   # no rank was started


def test_ctrl_c_while_the_ranks_start(tmp_path):
    proc, run_dir = start(tmp_path)
    assert wait_for(lambda: len(status_files(run_dir)) >= 1 or proc.poll() is not None, timeout=120, poll=0.02)
    out, took = signal_and_finish(proc, run_dir, signal.SIGINT)
    assert_interrupted(out, took, proc)
    assert report_exit(run_dir) == 130


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_mid_hang_names_the_stuck_rank_s_line(tmp_path, sig):
    proc, run_dir = start(tmp_path)
    assert wait_for(lambda: waiting_in_all_reduce(run_dir, (1, 2)) or proc.poll() is not None, timeout=120)
    out, took = signal_and_finish(proc, run_dir, sig, group=sig == signal.SIGINT)   # SIGTERM: to distcheck alone
    assert_interrupted(out, took, proc)
    assert WAIT_LINE in out, out   # rank 0's Event.wait() line, from its stack taken before the teardown
    assert report_exit(run_dir) == 130


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    proc, run_dir = start(tmp_path)
    assert wait_for(lambda: waiting_in_all_reduce(run_dir, (1, 2)) or proc.poll() is not None, timeout=120)
    os.killpg(proc.pid, signal.SIGINT)
    out, took = signal_and_finish(proc, run_dir, signal.SIGINT)
    assert proc.returncode == 130 and took <= ENDED_WITHIN_S, (took, out[-2000:])
    assert "Traceback" not in out


def test_timeout_says_so_in_every_view_and_a_script_is_judged_as_a_script(distcheck, tmp_path):
    """One launch: the terminal, JSON, JUnit, ``distcheck runs`` and ``distcheck analyze`` all name the
    end the same way, and none judges the script against an expectation it never declared."""
    import xml.etree.ElementTree as ET

    junit = tmp_path / "junit.xml"
    run = distcheck("run", str(STUCK), "--nproc-per-node", "3", "--stall-timeout", "120", "--timeout", "8",
                    "--junit-xml", str(junit), timeout=120)
    assert run.returncode == 4, run.stdout[-3000:]
    assert "stuck_on_event.py: hang (ended by --timeout)" in run.stdout, run.stdout
    assert run.report["end_reason"] == run.report["scenarios"][0]["end_reason"] == "timeout"
    [failure] = ET.parse(junit).getroot().iter("failure")
    assert failure.get("message").startswith("stuck_on_event.py: hang (ended by --timeout): ")
    assert "expected" not in failure.get("message") + failure.text
    runs = run_distcheck(["runs", "--dir", str(run.run_dir.parent)], tmp_path, run.run_dir, timeout=60)
    assert runs.returncode == 0 and "ended by --timeout" in runs.stdout, runs.stdout
    analyzed = run_distcheck(["analyze", str(run.run_dir)], tmp_path, run.run_dir, timeout=60)
    assert analyzed.returncode == 4 and "stuck_on_event.py: hang (ended by --timeout)" in analyzed.stdout
    assert "expected" not in analyzed.stdout, analyzed.stdout


def test_the_quick_start_prints_no_torch_log_line(distcheck):
    """The quick start's crash makes torch's launcher log the failed rank (and, when a peer is still running,
    "Terminating process ... via signal SIGTERM"): such lines go to the launch's logs/launcher.log, never to
    the terminal."""
    run = distcheck("run", "collectives_sanity", "confmat_local_num_classes", "ddp_uneven_inputs", timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout + run.stderr
    torch_lines = [line for line in out.splitlines()
                   if re.match(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", line) or "torchelastic" in line
                   or re.search(r"torch/\S+\.py:\d+\]", line)]
    assert not torch_lines, torch_lines
    logged = "".join(p.read_text() for p in run.run_dir.glob("*/logs/launcher.log"))
    # the lines were routed, not lost; which of them torch writes depends on whether the crashed rank's peer
    # had already ended, so the test asks for torch's elastic logger, not one sentence
    assert re.search(r"torch\.distributed\.elastic\S*\] ", logged), logged[-2000:]
    ends = {s["name"]: s["end_reason"] for s in run.report["scenarios"]}
    assert ends == {"collectives_sanity": "completed", "confmat_local_num_classes": "crash",
                    "ddp_uneven_inputs": "certain_hang"}, ends
    assert "ddp_uneven_inputs  expected hang, observed hang (ended at a certain hang)" in run.stdout


@pytest.mark.parametrize("form", ["script", "command"])
def test_a_rank_that_leaves_early_is_named_with_its_exit_line(distcheck, form):
    """``distcheck run early_exit.py`` and ``distcheck run -- torchrun ... early_exit.py`` alike."""
    early = SCRIPTS / "early_exit.py"
    line = next(i for i, text in enumerate(early.read_text().splitlines(), 1) if "sys.exit" in text)
    how = [str(early), "--nproc-per-node", "2"] if form == "script" else \
        ["--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(early)]
    run = distcheck("run", "--stall-timeout", "5", *how, timeout=120)
    assert run.returncode == 1, run.stdout[-3000:]
    hang = next(f for f in run.report["scenarios"][0]["findings"] if f["kind"] == "hang")
    assert "rank 1" in hang["summary"] and f"early_exit.py:{line}" in hang["summary"], hang["summary"]
    assert "sys.exit" in hang["summary"]
