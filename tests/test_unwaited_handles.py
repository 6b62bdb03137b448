"""An async collective whose handle some ranks never waited on before they went on: named at its line, with
the ranks that went on and those that waited, where the ranks parted after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcheck.diagnose.unwaited import find_unwaited_handles
from distcheck.models import Event, Finding, Kind, Severity

SCRIPT = Path(__file__).parent / "scripts" / "async" / "unwaited_handle.py"


def _event(rank: int, seq: int, op: str, t: float, async_op: bool = False) -> Event:
    return Event(rank=rank, group="0", seq=seq, op=op, t_enter=t, t_exit=t + 0.1, async_op=async_op,
                 callsite=f"train.py:{10 + seq}:main")


PARTED = Finding(kind=Kind.MISMATCH, severity=Severity.ERROR, summary="they parted", op="all_reduce", seq=2)


def _traces() -> dict[int, list[Event]]:
    return {r: [_event(r, 1, "all_reduce", 1.0, async_op=True), _event(r, 2, "all_reduce", 3.0)] for r in (0, 1, 2)}


def test_ranks_that_went_on_without_waiting_are_named_at_the_async_calls_line():
    waited = {0: {("0", 1): 2.0}, 2: {("0", 1): 2.5}}   # rank 1 never waited
    [finding] = find_unwaited_handles(_traces(), waited, [PARTED])
    assert (finding.kind, finding.severity, finding.seq, finding.odd_ranks) == ("order", "error", 1, (1,))
    assert finding.callsite == "train.py:11:main" and finding.data["waited"] == [0, 2]
    assert "Rank 1 went on from all_reduce #1 (async_op=True) at train.py:11:main" in finding.summary
    assert "ranks 0, 2 waited" in finding.summary


def test_a_wait_after_the_next_call_is_no_wait_before_going_on():
    waited = {0: {("0", 1): 2.0}, 1: {("0", 1): 3.5}, 2: {("0", 1): 2.5}}   # rank 1 waited only after call #2
    [finding] = find_unwaited_handles(_traces(), waited, [PARTED])
    assert finding.odd_ranks == (1,)


@pytest.mark.parametrize("waited, later", [
    ({0: {("0", 1): 2.0}, 1: {("0", 1): 2.0}, 2: {("0", 1): 2.0}}, [PARTED]),   # everyone waited
    ({}, [PARTED]),                                                              # nobody did: alike
    ({0: {("0", 1): 2.0}}, []),                                                  # the ranks never parted
    ({0: {("0", 1): 2.0}}, [Finding(kind=Kind.STRAGGLER, severity=Severity.WARNING, summary="late")]),
])
def test_no_finding_where_the_ranks_agree_or_never_parted(waited, later):
    assert find_unwaited_handles(_traces(), waited, later) == []


@pytest.mark.e2e
def test_an_early_stop_on_an_unwaited_all_reduce_is_named_where_the_ranks_parted(distcheck):
    r = distcheck("run", str(SCRIPT), "--nproc-per-node", "2", "--stall-timeout", "3")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    [s] = r.report["scenarios"]
    lines = SCRIPT.read_text().splitlines()
    asynchronous = next(i for i, line in enumerate(lines, 1) if "# ASYNC" in line)
    [unwaited] = [f for f in s["findings"] if f.get("data", {}).get("cause") == "unwaited_handle"]
    assert unwaited["odd_ranks"] == [1] and unwaited["data"]["waited"] == [0]
    assert unwaited["callsite"].endswith(f"unwaited_handle.py:{asynchronous}:main")
    assert s["findings"][0] == unwaited   # the root cause comes first
    assert any(f["kind"] in ("mismatch", "hang") for f in s["findings"] if f is not unwaited)
