"""NCCL's semantics, end to end, on the backend the host sees as NCCL (``distcheck.testing.emulated_nccl``): a call
returns at once and the rank blocks later, at a device sync. The shapes NCCL users meet, each judged by the code NCCL
runs (only the completion source is the emulated backend's hook instead of the Flight Recorder):

* rank 0 all_reduces and blocks at its sync, rank 1 finished: a certain hang within a second, both lines named;
* four ranks, rank 3 stuck reading a pipe: ranks 0-2 waiting, rank 3 stuck at its line, at --stall-timeout;
* a 10- against a 12-element all_reduce: a mismatch with both shapes;
* every rank in one call that never completes (the link went down): "every rank entered it but it never completed";
* DDP with one more step on rank 0: the same verdict on each of three runs;
* a rank whose script ends with a call that never completed: never a pass;
* NCCL's watchdog ending a rank at the job's own (short) timeout: a reaction, the hang still told, and why the
  backend could end it first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch_group import run_together
from test_determinism_e2e import verdict

# One worker with test_nccl_lane_e2e's launches, one group after the other: started together, these ten jobs beside
# the whole catalogue on two backends were still starting when their 90 s --timeout came.
pytestmark = [pytest.mark.e2e, pytest.mark.nccl_semantics, pytest.mark.xdist_group("nccl_lane")]

SCRIPTS = Path(__file__).parent / "scripts" / "nccl_semantics"
FAST = ("--stall-timeout", "5", "--timeout", "90")


def _line(script: str, marker: str) -> int:
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if f"# {marker}" in line)


def _site(script: str, marker: str) -> str:
    return f"{script}:{_line(script, marker)}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every shape's job at once (each its own distcheck run), DDP's three times."""
    pipe = tmp_path_factory.mktemp("pipe") / "never-written"
    os.mkfifo(pipe)
    pipe2 = tmp_path_factory.mktemp("pipe") / "never-written"
    os.mkfifo(pipe2)
    jobs = {
        "rank0_sync": [str(SCRIPTS / "rank0_sync.py"), "--nproc-per-node", "2", *FAST],
        "stuck_reading": [str(SCRIPTS / "stuck_reading.py"), "--nproc-per-node", "4", *FAST, "--", str(pipe)],
        "shape_mismatch": [str(SCRIPTS / "shape_mismatch.py"), "--nproc-per-node", "2", *FAST],
        "network_fault": [str(SCRIPTS / "network_fault.py"), "--nproc-per-node", "2", *FAST],
        "extra_call_no_sync": [str(SCRIPTS / "extra_call_no_sync.py"), "--nproc-per-node", "2", *FAST],
        **{f"ddp_skip_{i}": [str(SCRIPTS / "ddp_skip.py"), "--nproc-per-node", "2", *FAST] for i in range(3)},
        "backend_timeout": [str(SCRIPTS / "backend_timeout.py"), "--nproc-per-node", "2", "--stall-timeout", "30",
                            "--timeout", "90", "--", str(pipe2)],
    }
    return run_together(jobs, lambda name: tmp_path_factory.mktemp(name), timeout=400)


def _only(run) -> dict:
    [s] = run.report["scenarios"]
    return s


def _errors(s: dict, kind: str) -> list[dict]:
    return [f for f in s["findings"] if f["kind"] == kind and f["severity"] == "error"]


def test_a_call_that_returned_and_never_completed_beside_a_finished_peer_is_a_certain_hang_in_a_second(runs):
    run = runs["rank0_sync"]
    s = _only(run)
    assert run.returncode == 1 and s["end_reason"] == "certain_hang", run.stdout[-3000:]
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["callsite"].endswith(_site("rank0_sync.py", "ALL_REDUCE") + ":<module>")
    assert f"the host is blocked at {SCRIPTS / 'rank0_sync.py'}:{_line('rank0_sync.py', 'SYNC')}" in hang["summary"]
    assert s["detected_at"] - s["stall_onset"] <= 1.0
    assert not _errors(s, "crash")   # never NCCL's time-out, never a crash
    # the backend stated is the one the script initialized, not --backend's default (gloo)
    assert run.report["run"]["backend"] == "emulated_nccl" and "emulated_nccl × 2 ranks" in run.stdout


def test_ranks_waiting_on_the_device_for_a_rank_stuck_in_a_read_are_a_hang_at_the_stall_timeout(runs):
    s = _only(runs["stuck_reading"])
    assert s["end_reason"] == "stall"
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0, 1, 2] and hang["absent_ranks"] == [3]
    ranks = {r["rank"]: r for r in s["ranks"]}
    assert ranks[3]["where"].endswith(_site("stuck_reading.py", "READ") + ":<module>")
    assert {ranks[r]["state"] for r in (0, 1, 2)} == {"stuck"}


def test_a_shape_mismatch_is_named_with_both_shapes(runs):
    s = _only(runs["shape_mismatch"])
    mismatch = _errors(s, "mismatch")[0]
    assert "shape" in mismatch["fields"]
    assert "[10] on rank 0" in mismatch["summary"] and "[12] on rank 1" in mismatch["summary"]


def test_a_call_every_rank_entered_that_never_completes_is_a_hang_that_says_so(runs):
    s = _only(runs["network_fault"])
    assert s["end_reason"] == "stall"
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0, 1] and not hang["absent_ranks"]
    assert "every rank entered it but it never completed" in hang["summary"]
    assert hang["callsite"].endswith(_site("network_fault.py", "ALL_REDUCE") + ":<module>")


def test_a_rank_whose_script_ended_with_a_call_that_never_completed_is_never_a_pass(runs):
    run = runs["extra_call_no_sync"]
    s = _only(run)
    assert run.returncode == 1 and run.report["verdict"] == "fail"
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["callsite"].endswith(_site("extra_call_no_sync.py", "EXTRA") + ":<module>")
    assert "finished: its script ended" in hang["summary"]
    assert not [f for f in s["findings"] if f["kind"] == "coverage" and "lost records" in f["summary"]]


def test_ddp_skipping_a_step_on_one_rank_gives_the_same_verdict_on_every_run(runs):
    verdicts = {verdict(_only(runs[f"ddp_skip_{i}"])) for i in range(3)}
    assert len(verdicts) == 1, verdicts
    s = _only(runs["ddp_skip_0"])
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["callsite"].endswith(_site("ddp_skip.py", "BACKWARD") + ":<module>")


def test_nccls_watchdog_abort_is_a_reaction_and_the_report_says_the_backend_ended_it_first(runs):
    s = _only(runs["backend_timeout"])
    assert not _errors(s, "crash")   # rank 0 SIGABRTed by the watchdog: evidence of where it waited, not a cause
    [hang] = _errors(s, "hang")
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    ranks = {r["rank"]: r for r in s["ranks"]}
    assert ranks[1]["where"].endswith(_site("backend_timeout.py", "READ") + ":<module>")
    [note] = [f for f in s["findings"] if f["kind"] == "coverage" and "process-group timeout" in f["summary"]]
    assert note["severity"] == "warning" and "(4 s" in note["summary"]
