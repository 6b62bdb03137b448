"""Every collective seen, late told from hung (issue 12): real gloo jobs through the real CLI.

Collectives issued from C++ (DDP's reducer, direct ProcessGroup calls) are hangs like any other,
numbered by the group's own counter; a rank busy in its own code is late, not hung.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import findings_less_torch_notes
from distcheck.torch_features import features

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts"


def line_of(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if f"# {marker}" in line)


def only(report: dict) -> dict:
    [s] = report["scenarios"]
    return s


def test_ddp_with_uneven_inputs_is_a_hang_in_the_reducers_all_reduce_on_the_backward_line(distcheck):
    script = SCRIPTS / "ddp_uneven.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "5", timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    s = only(r.report)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    if not features().flight_recorder_gloo:   # torch < 2.8: named from rank 0's stack, the op unknown
        assert (hang["op"], hang["seq"], hang["waiting_ranks"], hang["absent_ranks"]) == ("?", 8, [0], [1])
        assert hang["label"].startswith("DDP's reducer in backward() (a collective issued from C++")
        assert hang["callsite"].startswith(f"{script}:{line_of(script, 'BACKWARD')}:")
        assert hang["detected_after_s"] <= 5 + 1
        return
    assert (hang["op"], hang["waiting_ranks"], hang["absent_ranks"]) == ("all_reduce", [0], [1])
    assert hang["label"] == "DDP gradient all_reduce, bucket of 5 elements"
    assert hang["callsite"].startswith(f"{script}:{line_of(script, 'BACKWARD')}:")
    assert hang["detected_after_s"] <= 5 + 1
    assert s["ended_at"] - s["stall_onset"] <= 5 + 3
    # numbered by the group's own counter: the Flight Recorder of rank 0 says the same
    rank0 = next(x for x in s["ranks"] if x["rank"] == 0)
    assert rank0["flight_recorder"]["0"]["last_enqueued_collective"] == hang["seq"] == 8
    assert [f["kind"] for f in s["findings"]] == ["hang"]


def test_healthy_ddp_runs_clean_and_the_barrier_after_it_has_the_groups_number(distcheck):
    script = SCRIPTS / "ddp_uneven.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "5", "--", "--even", "--unused",
                  timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    s = only(r.report)
    assert findings_less_torch_notes(s) == [] and s["collectives_compared"] >= 8
    log = (Path(s["launch_dir"]) / "logs" / "rank0.log").read_text()
    seq = int(log.split("barrier #")[1].split()[0])
    if not features().flight_recorder_gloo:
        # torch < 2.8: a C++-issued call is stamped when the sidecar saw it, which may be after the barrier
        # began; its number still says where it was. The barrier in the record has the group's number.
        from distcheck.files.trace_reader import parse_trace

        events = parse_trace(0, (Path(s["launch_dir"]) / "traces" / "rank0.trace").read_bytes()).events
        assert [e.seq for e in events if e.op == "barrier"] == [seq]
        return
    trace_barrier = next(x for x in s["ranks"] if x["rank"] == 0)["last_event"]
    assert trace_barrier["op"] == "barrier" and trace_barrier["seq"] == seq


@pytest.mark.skipif(not features().flight_recorder_gloo, reason=(
    "a ProcessGroup method called from the user's own line leaves no issuer on the stack, and gloo has no "
    "Flight Recorder before torch 2.8 to say the call is still open: such a hang ends at --timeout there"))
def test_a_direct_process_group_call_on_one_rank_is_a_hang_on_its_line(distcheck):
    script = SCRIPTS / "direct_pg_call.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "3", timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [hang] = [f for f in only(r.report)["findings"] if f["kind"] == "hang"]
    assert (hang["op"], hang["seq"], hang["waiting_ranks"], hang["absent_ranks"]) == ("all_reduce", 1, [0], [1])
    assert hang["callsite"].startswith(f"{script}:{line_of(script, 'DIRECT')}:")


def test_a_rank_busy_in_its_own_code_is_late_not_hung(distcheck):
    """Rank 0 computes 7 s, past --stall-timeout 4, before its barrier (the default busy timeout)."""
    script = SCRIPTS / "late_rank0.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "4", "--", "--busy-s", "7",
                  timeout=150)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    s = only(r.report)
    assert s["ok"] and s["end_reason"] == "completed"
    [late] = s["findings"]
    assert (late["kind"], late["severity"], late["op"]) == ("straggler", "warning", "barrier")
    assert late["odd_ranks"] == [0] and late["waiting_ranks"] == [1]
    assert late["data"]["waited_s"] >= 6
    assert late["data"]["busy_at"].startswith(f"{script}:{line_of(script, 'BUSY')}:")
    assert "late, not hung" in r.stdout


def test_a_rank_busy_past_the_busy_timeout_is_a_hang_naming_its_busy_line(distcheck):
    script = SCRIPTS / "late_rank0.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--stall-timeout", "2", "--busy-timeout", "5",
                  "--", "--busy-s", "600", timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [hang] = [f for f in only(r.report)["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [1] and hang["absent_ranks"] == [0]
    assert 5 - 0.5 <= hang["detected_after_s"] <= 5 + 2
    assert f"late_rank0.py:{line_of(script, 'BUSY')}" in hang["summary"]
    assert only(r.report)["end_reason"] == "busy_timeout" and "(ended by --busy-timeout)" in r.stdout   # its own end


def test_the_object_count_is_compared_and_the_sender_is_the_odd_one(distcheck):
    script = SCRIPTS / "object_count.py"
    r = distcheck("run", str(script), "--nproc-per-node", "3", "--stall-timeout", "3", timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [m] = [f for f in only(r.report)["findings"] if f["kind"] == "mismatch"]
    assert (m["op"], m["fields"], m["odd_ranks"]) == ("broadcast_object_list", ["shape"], [0])


def test_without_the_flight_recorder_cpp_issued_calls_are_named_as_unwatched(distcheck):
    script = SCRIPTS / "ddp_uneven.py"
    r = distcheck("run", str(script), "--nproc-per-node", "2", "--no-flight-recorder", "--", "--even", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    [note] = only(r.report)["findings"]
    assert (note["kind"], note["severity"]) == ("coverage", "info")
    why = "the Flight Recorder is off" if features().flight_recorder_gloo else "has no Flight Recorder on gloo"
    assert "counted but not watched: " in note["summary"] and why in note["summary"]
