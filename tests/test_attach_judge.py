"""attach's judging on hand-built views (pure, milliseconds): ranks nobody read, a trickle of I/O, an unreadable
sample, the Flight Recorder join by sequence number, and a view's round trip between nodes."""

from __future__ import annotations

import pytest

from distcheck.attach.flight import FrCall, FrState
from distcheck.attach.judge import IO_FLOOR_BPS, RankView, judge
from distcheck.attach.nodes import attach_nodes, view_from_dict, view_to_dict
from distcheck.errors import UsageError
from distcheck.launch.slurm import endpoint_port
from distcheck.attach.position import Position
from distcheck.attach.read import ProcState
from distcheck.diagnose.verdict import Scenario
from distcheck.launch.procs import Activity

WAIT = Position("collective", "all_reduce", None, "job.py:82:main", None, None, 11, "stack of rank 0", calls=1)
POLL = Position("outside", None, None, "job.py:28:poll_for", None, None, 22, "stack of a polling rank", calls=2)
PAST = Position("outside", None, None, "job.py:131:main", None, None, 33, "in work.wait()", calls=3)
SCENARIO = Scenario(name="attach", source="job")


def view(rank: int, at: Position, *, io: int = 0, cores: float = 0.0, fr: FrState | None = None, node: int = 0,
         samples: int = 3) -> RankView:
    return RankView(rank, 1000 + rank, (at,) * samples, Activity(10.0, 2.0, cores, io, 0), ProcState(True, "S"),
                    host="h", node=node, fr=fr)


def verdict(views: dict[int, RankView], world: int, **kw):
    return judge(views, world, SCENARIO, started=1.0, ended=3.0, **kw).result


def kinds(result) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in result.findings:
        out.setdefault(f.kind, []).append(f)
    return out


def test_a_hang_with_idle_absent_ranks_is_certain_from_outside():
    result = verdict({0: view(0, WAIT), 1: view(1, POLL), 2: view(2, POLL)}, 3)
    [hang] = kinds(result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2)
    assert "certain from outside" in hang.summary and "stacks and /proc only" in hang.summary


def test_ranks_nobody_read_leave_the_hang_undecided_and_are_named():
    result = verdict({0: view(0, WAIT), 1: view(1, POLL)}, 4, unread_why="node 1's attach never came")
    found = kinds(result)
    assert "hang" not in found
    [note] = found["coverage"]
    assert note.severity == "warning" and note.data["unread_ranks"] == [2, 3] and note.waiting_ranks == (0,)
    assert "node 1's attach never came" in note.summary and "job.py:82" in note.summary


def test_a_trickle_of_io_is_no_progress_but_real_io_is():
    trickle = int(IO_FLOOR_BPS * 2.0) - 1          # a log line now and then over the 2 s span
    result = verdict({0: view(0, WAIT), 1: view(1, POLL, io=trickle)}, 2)
    assert [f.kind for f in result.findings if f.severity == "error"] == ["hang"]
    busy = verdict({0: view(0, WAIT), 1: view(1, POLL, io=64 * 1024)}, 2)
    assert not [f for f in busy.findings if f.severity == "error"]
    [late] = kinds(busy)["straggler"]
    assert "64.0 KiB" in late.summary and "late, not hung" in late.summary


def test_an_unreadable_sample_does_not_move_a_waiting_rank():
    timed_out = Position("unreadable", stack="py-spy did not answer in 5 s")
    rank0 = RankView(0, 1000, (WAIT, timed_out, WAIT), Activity(10.0, 2.0, 0.0, 0, 0), ProcState(True, "S"))
    result = verdict({0: rank0, 1: view(1, POLL)}, 2)
    [hang] = kinds(result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1,)


def _fr(seq: int, open_: bool) -> FrState:
    call = FrCall("0:default_pg", seq, "all_reduce", ((4,),), ("float32",), "job.py:120:main")
    return FrState(f"/tmp/fr_{seq}", {"0:default_pg": call}, call if open_ else None)


def test_the_flight_recorder_joins_by_sequence_number_a_rank_past_its_call():
    """Rank 0's Python thread is in ``work.wait()`` (no collective on its stack): its dump has #6 in flight."""
    views = {0: view(0, PAST, fr=_fr(6, True)), 1: view(1, POLL, fr=_fr(5, False)), 2: view(2, POLL, fr=_fr(5, False))}
    [hang] = kinds(verdict(views, 3))["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2) and hang.seq == 6
    assert "all_reduce #6" in hang.summary and "job.py:131" in hang.callsite
    assert "Flight Recorder dumps of every rank, joined by sequence number" in hang.summary
    assert "never entered by ranks 1, 2" in hang.summary


def test_dumps_older_than_the_hang_are_not_joined():
    """The stack waits in a collective, the dump holds no call in flight: the dump predates the hang."""
    views = {0: view(0, WAIT, fr=_fr(5, False)), 1: view(1, POLL, fr=_fr(5, False))}
    [hang] = kinds(verdict(views, 2))["hang"]
    assert "no Flight Recorder dump to join" in hang.summary and hang.waiting_ranks == (0,)


def test_without_flight_recorder_a_rank_past_its_call_is_not_called_waiting():
    result = verdict({0: view(0, PAST), 1: view(1, POLL)}, 2)
    assert not [f for f in result.findings if f.severity == "error"]


def test_a_view_crosses_to_node_0_unchanged():
    v = view(3, WAIT, io=5, cores=0.25, fr=_fr(6, True), node=1)
    assert view_from_dict(view_to_dict(v)) == v
    bare = view(2, POLL)
    assert view_from_dict(view_to_dict(bare)) == bare


def test_a_loop_polling_in_one_function_is_idle_a_move_between_functions_is_progress():
    """Under load a sample finds a polling rank on its loop's other line (``while not release.exists()``)."""
    other_line = Position("outside", None, None, "job.py:27:poll_for", None, None, 23, "on the while line", calls=2)
    poller = RankView(1, 1001, (POLL, other_line, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    [hang] = kinds(verdict({0: view(0, WAIT), 1: poller}, 2))["hang"]
    assert hang.absent_ranks == (1,) and "in the same functions in 3 samples" in hang.summary
    elsewhere = Position("outside", None, None, "job.py:40:load", None, None, 24, "loading", calls=4)
    mover = RankView(1, 1001, (POLL, elsewhere, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    result = verdict({0: view(0, WAIT), 1: mover}, 2)
    assert "hang" not in kinds(result) and "its stack moved" in kinds(result)["straggler"][0].summary


def test_a_rank_running_in_most_samples_is_late_though_a_crowded_node_gives_it_little_cpu():
    running = Position("outside", None, None, "job.py:33:busy_until", None, None, 44, "computing", calls=5,
                       active=True)
    starved = RankView(1, 1001, (running,) * 3, Activity(10.0, 2.0, 0.05, 0, 0), ProcState(True, "R"))
    result = verdict({0: view(0, WAIT), 1: starved}, 2)
    assert "hang" not in kinds(result)
    assert "its main thread was running in 3 of 3 samples" in kinds(result)["straggler"][0].summary
    awake = Position("outside", None, None, "job.py:27:poll_for", None, None, 23, "on the while line", calls=2,
                     active=True)   # a polling rank caught once between its sleeps
    caught_once = RankView(1, 1001, (POLL, awake, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    [hang] = kinds(verdict({0: view(0, WAIT), 1: caught_once}, 2))["hang"]
    assert hang.absent_ranks == (1,)


SLURM_STEP = {"SLURM_JOB_ID": "8812", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.2", "SLURM_STEP_NUM_TASKS": "2", "MASTER_PORT": "29500"}


def test_under_srun_each_node_s_attach_meets_node_0_by_slurm_s_variables_never_on_the_job_s_port():
    nodes = attach_nodes(None, None, None, None, 60.0, None, SLURM_STEP)
    assert (nodes.nnodes, nodes.node_rank) == (2, 1)
    assert nodes.rdzv_endpoint == f"127.0.0.1:{endpoint_port('8812')}" and nodes.store_address[1] != 29500


def test_several_nodes_without_an_endpoint_is_one_clear_line():
    with pytest.raises(UsageError, match="needs --rdzv-endpoint HOST:PORT"):
        attach_nodes(2, 0, None, None, 60.0, None, {})
    one = attach_nodes(None, None, None, None, 60.0, None, {"MASTER_PORT": "29500"})
    assert not one.multi
