"""The verdict is fixed when it is decided: what the job does during distcheck's teardown (its own SIGTERM handler
issuing a collective, as a job that saves or agrees to stop on pre-emption does) never changes who waited where; it
is told apart, as a note after the decision. Pure tests of the cut, and the job run as a script and as a command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distcheck.diagnose.teardown import split_at_decision, teardown_note
from distcheck.models import Event

from conftest import free_port

SCRIPT = Path(__file__).parent / "scripts" / "teardown" / "sigterm_collective.py"


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if f"# {marker}" in line)


def _e(seq: int, t_enter: float, t_exit: float | None, op: str = "all_reduce", error: str | None = None) -> Event:
    return Event(rank=0, group="0", seq=seq, op=op, t_enter=t_enter, t_exit=t_exit, error=error,
                 callsite="job.py:14:on_sigterm")


def test_a_call_entered_after_the_decision_is_left_out_and_one_open_then_stays_open():
    events = [_e(1, 1.0, 1.1), _e(2, 2.0, 9.0), _e(3, 6.0, 6.1, op="broadcast")]
    kept, after = split_at_decision(events, decided_at=5.0)
    assert [(e.seq, e.t_exit) for e in kept] == [(1, 1.1), (2, None)]   # #2 completed only in the teardown
    assert [e.seq for e in after] == [3]
    assert split_at_decision(events, None) == (events, [])   # the job ended by itself: everything stands
    [note] = teardown_note({0: after})
    assert note.kind == "coverage" and note.severity == "info"
    assert "rank 0 issued broadcast #3 (group 0) at job.py:14" in note.summary and "not part of the verdict" in note.summary


def test_a_teardown_call_issued_in_no_frame_of_the_users_is_placed_at_the_librarys_line_never_nowhere():
    """Lightning's handler issued broadcast and all_reduce in the teardown from its own frames only (a CI-run's
    note read "at an unknown place"): the library's line where there is one, else no place at all."""
    lib = Event(rank=1, group="0", seq=24, op="broadcast", t_enter=6.0, t_exit=None,
                library_callsite="lightning/pytorch/strategies/ddp.py:301:broadcast")
    bare = Event(rank=1, group="0", seq=25, op="all_reduce", t_enter=6.1, t_exit=None)
    [note] = teardown_note({1: [lib, bare]})
    assert "broadcast #24 (group 0) at lightning/pytorch/strategies/ddp.py:301" in note.summary, note.summary
    assert "issued all_reduce #25 (group 0):" in note.summary and "unknown place" not in note.summary, note.summary


def test_a_call_that_failed_in_the_teardown_keeps_its_error():
    kept, _ = split_at_decision([_e(1, 1.0, 9.0, error="RuntimeError: Connection closed by peer")], 5.0)
    assert kept[0].t_exit == 9.0 and kept[0].error


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["command", "script"])
def test_a_sigterm_handler_that_issues_a_collective_in_the_teardown_changes_nothing(distcheck, mode):
    if mode == "command":
        r = distcheck("run", "--stall-timeout", "3", "--", sys.executable, "-m", "torch.distributed.run",
                      "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT))
    else:
        r = distcheck("run", str(SCRIPT), "--nproc-per-node", "2", "--stall-timeout", "3")
    assert r.returncode == 1, r.stdout[-3000:]
    assert_the_teardown_changed_nothing(r.report, r.stdout)


def assert_the_teardown_changed_nothing(report: dict, output: str) -> None:
    """The stall as decided: rank 1 waiting in the barrier, rank 0 asleep outside every collective; the broadcast
    rank 0's SIGTERM handler issued in the teardown, if it got to run, only as a note after the verdict."""
    [s] = report["scenarios"]
    assert s["end_reason"] == "stall", output[-3000:]
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [1] and hang["absent_ranks"] == [0]
    assert hang["callsite"].endswith(f"sigterm_collective.py:{_line('BARRIER')}:<module>")
    assert f"running outside any collective at {SCRIPT}:{_line('ASLEEP')}" in hang["summary"]
    ranks = {x["rank"]: x for x in s["ranks"]}
    assert ranks[0]["state"] == "running" and ranks[0]["where"].endswith(f":{_line('ASLEEP')}:<module>")
    notes = [f for f in s["findings"] if (f.get("data") or {}).get("after_decision")]
    for note in notes:   # if the handler got to run before it was ended, its call is told apart, after the verdict
        assert f"sigterm_collective.py:{_line('HANDLER')}" in note["summary"]
    assert "broadcast" not in json.dumps(hang)
