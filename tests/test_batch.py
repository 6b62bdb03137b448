"""Scenarios sharing one launch: planning, splitting traces, and a batch that fails midway."""

from __future__ import annotations

import pytest

from distcheck.scenario import ScenarioSpec
from distcheck.targets.scenario import ScenarioTarget
from distcheck.targets.shared import SharedLaunch, plan
from distcheck.files.trace_reader import split_segments


def spec(name: str, *expect: str) -> ScenarioTarget:
    return ScenarioTarget(ScenarioSpec(name=name, file=f"/x/{name}.py", expect=expect or ("pass",)))


def names(unit) -> list[str]:
    return [s.name for s in unit.scenarios] if isinstance(unit, SharedLaunch) else [unit.name]


def test_plan_shares_a_launch_except_for_expected_hangs_and_crashes():
    specs = [spec("a"), spec("h", "hang"), spec("n", "numeric"), spec("m", "mismatch"), spec("o", "order", "numeric")]
    units = plan(specs, batching=True)
    assert [names(u) for u in units] == [["a", "n", "o", "m"], ["h"]]   # mismatches last
    assert [names(u) for u in plan(specs, batching=False)] == [["a"], ["h"], ["n"], ["m"], ["o"]]


def test_split_segments_cuts_at_B_records_and_keeps_a_torn_tail():
    from distcheck.files.trace import (VERSION_LINE, enter_slot, exit_slot, call_key, fingerprint_record,
                                       group_record, segment_record, text_slots)
    from distcheck.files.trace_reader import parse_trace

    defs = text_slots(group_record(0, "0", (0, 1)) + fingerprint_record(0, "barrier", None, "-", "-", "-", None,
                                                                        False, "-"))
    long = "a_scenario_whose_name_spans_several_slots"
    data = (text_slots(VERSION_LINE) + segment_record(long) + defs + enter_slot(0, 0, 1, 5) + exit_slot(call_key(0, 1), 6)
            + segment_record("b") + defs + enter_slot(0, 0, 1, 9))
    torn = data[:-5] + bytes(4096)          # killed in the middle of b's record, with the preallocated end
    parts = split_segments(torn)
    assert list(parts) == [long, "b"]
    a, b = parse_trace(0, parts[long]), parse_trace(0, parts["b"])
    assert [(e.op, e.seq, e.t_exit) for e in a.events] == [("barrier", 1, 6e-9)] and not a.truncated
    assert b.events == [] and b.truncated
    assert split_segments(b"") == {}


BATCH = '''
from distcheck import scenario


@scenario(expect="pass")
def first_ok(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    ctx.check_close("sum", t, torch.full((2,), float(ctx.world_size)))


@scenario(expect="pass")
def second_hangs(ctx):
    """Expected to pass, but rank 0 alone enters a barrier: the shared launch is poisoned."""
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.barrier()


@scenario(expect="pass")
def third_ok(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
'''


@pytest.mark.e2e
def test_a_batch_that_hangs_midway_reports_it_and_reruns_the_rest(distcheck, tmp_path):
    path = tmp_path / "batch.py"
    path.write_text(BATCH)
    r = distcheck("run", str(path), "--nproc-per-node", "2", "--stall-timeout", "3")
    assert r.returncode == 1, r.stderr[-3000:]
    report = r.report
    assert [s["name"] for s in report["scenarios"]] == ["first_ok", "second_hangs", "third_ok"]
    first, second, third = report["scenarios"]
    assert first["ok"] and first["end_reason"] == "completed" and first["collectives_compared"] == 1
    assert not second["ok"] and second["observed"] == ["hang"]
    [hang] = second["findings"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1] and hang["seq"] == 1
    assert {x["rank"]: x["state"] for x in second["ranks"]} == {0: "stuck", 1: "finished"}
    assert third["ok"] and third["collectives_compared"] == 1     # ran again, in a launch of its own
    for s in report["scenarios"]:   # each has an ordinary launch dir with its own part of the traces
        assert sorted(p.name for p in (r.run_dir / s["name"] / "traces").iterdir()) == ["rank0.trace", "rank1.trace"]


def test_rank_status_writes_the_json_the_worker_always_wrote(tmp_path):
    """Key order and null error fields as the worker's dict updates produced them."""
    import dataclasses
    import json

    from distcheck.files.launch_dir import LaunchFiles, RankStatus
    from distcheck.models import Phase

    old = {"rank": 1, "pid": 7, "host": "h", "node": 0, "main_thread": 9, "t_start": 1.0}
    status = RankStatus(**old)
    for fields in ({"phase": "starting"}, {"phase": "running", "pg_initialized": True},
                   {"phase": "error", "collectives": 3, "exit_code": 1, "exception": "ValueError: x",
                    "traceback": "tb", "where": None}):
        old.update(fields, t_update=2.0)
        status = dataclasses.replace(status, **{**fields, "phase": Phase(fields["phase"])}, t_update=2.0)
    files = LaunchFiles(tmp_path)
    files.make()
    files.write_status(1, status)
    assert files.status(1).read_text() == json.dumps(old)
    assert files.read_status(1) == status and files.read_status(1).phase is Phase.ERROR
    assert files.read_status(0) is None


def test_a_scenario_of_a_batch_gets_its_own_finished_status():
    from distcheck.files.launch_dir import RankStatus
    from distcheck.launch.batch import _status_for
    from distcheck.models import Phase

    batch = RankStatus(rank=0, pid=3, phase=Phase.RUNNING, current="b", collectives=9,
                       scenarios={"a": {"results": {"x": 1}, "collectives": 4, "t_start": 1, "t_end": 2}})
    a, b = _status_for(batch, "a"), _status_for(batch, "b")
    assert (a.phase, a.results, a.collectives, a.scenarios, a.current) == (Phase.FINISHED, {"x": 1}, 4, None, None)
    assert (b.phase, b.results, b.collectives, b.pid) == (Phase.RUNNING, None, None, 3)


def test_a_finished_scenario_keeps_no_exception_of_a_later_one():
    """The rank died in a later scenario of the launch: its error is not the finished one's."""
    from distcheck.files.launch_dir import RankStatus
    from distcheck.launch.batch import _status_for
    from distcheck.models import Phase

    batch = RankStatus(rank=0, phase=Phase.ERROR, current="b", exit_code=1,
                       exception="RuntimeError: Connection reset by peer", traceback="tb", where="x.py:3:b",
                       scenarios={"a": {"results": {}, "collectives": 2, "t_start": 1, "t_end": 2}})
    a, b = _status_for(batch, "a"), _status_for(batch, "b")
    assert (a.phase, a.exception, a.traceback, a.where, a.exit_code) == (Phase.FINISHED, None, None, None, None)
    assert (b.phase, b.exception, b.exit_code) == (Phase.ERROR, "RuntimeError: Connection reset by peer", 1)


ABORTING = '''
from distcheck import scenario


@scenario(expect="count")
def a_aborts(ctx):
    """Rank 1 raises while rank 0 waits in an all_reduce: gloo resets rank 0's connection."""
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))


@scenario(expect="pass")
def b_ok(ctx):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))


@scenario(expect="pass")
def c_ok(ctx):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2))
'''


@pytest.mark.e2e
def test_a_shared_launch_with_an_aborting_scenario_keeps_exceptions_where_they_happened(distcheck, tmp_path):
    """Names sort a, b, c; the launch runs b, c (healthy first), then a, which aborts a rank."""
    path = tmp_path / "aborting.py"
    path.write_text(ABORTING)
    r = distcheck("run", str(path), "--nproc-per-node", "2", "--stall-timeout", "5", "-v")
    assert r.returncode == 1, r.stderr[-3000:]
    report = r.report
    assert [s["name"] for s in report["scenarios"]] == ["b_ok", "c_ok", "a_aborts"]   # the order they ran
    b, c, a = report["scenarios"]
    assert b["ok"] and c["ok"]
    assert [x["exception"] for x in b["ranks"] + c["ranks"]] == [None] * 4
    assert "ValueError: rank 1 gives up" in [x["exception"] for x in a["ranks"]]
    # Plain output (not a terminal) at -v: a start line for every scenario, counted in run order.
    starts = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("RUN ")]
    assert starts == ["RUN  b_ok  [1/3]", "RUN  c_ok  [2/3]", "RUN  a_aborts  [3/3]"], r.stdout
    assert f"wrote {r.json_path}" in r.stdout      # --json PATH says where it went, like the other outputs
    # `distcheck report` shows them in the same order
    again = distcheck("report", str(r.run_dir), json=False)
    order = [n for line in again.stdout.splitlines() for n in ("b_ok", "c_ok", "a_aborts")
             if line.lstrip().startswith(("OK", "FAIL")) and f" {n} " in line]
    assert order == ["b_ok", "c_ok", "a_aborts"], again.stdout


def test_after_a_crash_a_survivor_done_with_its_part_of_the_scenario_is_not_waited_for(tmp_path):
    """A shared launch's rank that finished its part of the scenario waits for its peers at the scenario's end,
    its record complete: once a peer failed, torch's agent is not held for it (it held the launch until the
    survivor's --stall-timeout). A rank still on its way to a call is, as before."""
    import subprocess
    import sys
    import time

    from distcheck.files.launch_dir import LaunchFiles, RankStatus
    from distcheck.launch.survivors import _wait_for_synced_records
    from distcheck.models import Phase

    files = LaunchFiles(tmp_path)
    files.make()
    files.traces.mkdir(parents=True, exist_ok=True)
    (files.traces / "rank0.trace").write_bytes(b"")
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        waiting = RankStatus(rank=0, pid=idle.pid, phase=Phase.RUNNING, current="b",
                             scenarios={"a": {}, "b": {"results": {}, "collectives": 1}})
        files.write_status(0, waiting)
        start = time.monotonic()
        _wait_for_synced_records(files, time.time(), idle_s=60.0)
        assert time.monotonic() - start < 30.0          # at once, not after its 60 s without progress
        files.write_status(0, RankStatus(rank=0, pid=idle.pid, phase=Phase.RUNNING, current="b",
                                         scenarios={"a": {}}))
        start = time.monotonic()
        _wait_for_synced_records(files, time.time(), idle_s=0.5)
        assert time.monotonic() - start >= 0.5          # on its way: waited for until it stopped progressing
    finally:
        idle.kill()
        idle.wait()


def test_the_scenario_a_shared_launch_died_in_began_where_the_one_before_it_ended(tmp_path):
    """Its duration is its own, not the whole launch's (a mismatch at the end of the built-ins' shared launch
    read 18-24 s, the time of every scenario before it)."""
    from distcheck.files.launch_dir import LaunchFiles, RankStatus
    from distcheck.launch.batch import split
    from distcheck.launch.launcher import LaunchOutcome
    from distcheck.launch.watchdog import WatchdogResult
    from distcheck.models import EndReason, Phase

    batch = LaunchFiles(tmp_path / "batch-1")
    batch.make()
    a_done = {"results": {}, "collectives": 1, "t_start": 10.0, "t_end": 12.0}
    for rank, t_end in ((0, 12.0), (1, 12.5)):
        batch.write_status(rank, RankStatus(rank=rank, phase=Phase.ERROR if rank else Phase.RUNNING, current="b",
                                            scenarios={"a": {**a_done, "t_end": t_end}}))
    outcome = LaunchOutcome(end_reason=EndReason.CRASH, started_at=1.0, ended_at=14.0, watchdog=WatchdogResult())
    parts = split(batch, [spec("a").spec, spec("b", "mismatch").spec], 2, outcome, tmp_path)
    [(a, _, a_outcome)] = parts.completed
    b, _, b_outcome = parts.failed
    assert (a.name, a_outcome.started_at, a_outcome.ended_at) == ("a", 10.0, 12.5)
    assert (b.name, b_outcome.started_at, b_outcome.ended_at, b_outcome.end_reason) == ("b", 12.5, 14.0, EndReason.CRASH)
