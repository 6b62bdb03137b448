"""Library shapes on hand-built traces: gloo's monitored_barrier, a barrier against a data call, the
files the user named, DTensor's full_tensor() on one rank, a DeviceMesh group mixed up. Pure: no processes, milliseconds each."""

from __future__ import annotations

import dataclasses
import os

from distcheck.diagnose.rules import RunFacts, analyze
from distcheck.diagnose.common import group_table
from distcheck.diagnose.out_of_step import out_of_step_ranks
from distcheck.diagnose.unrecorded import is_unrecorded, unrecorded_call, with_unrecorded_calls
from distcheck.files import user_code
from distcheck.files.stacks import LIBRARY, USER, classify_file, torch_dir
from distcheck.knowledge.library_shapes import functional_call_in, group_pattern, wire_op, waits_elsewhere
from distcheck.models import Event, Kind, RankOutcome

SITE = "/home/u/train.py:{}:main"


def ev(rank: int, seq: int, op: str = "all_reduce", *, members=(0, 1), shapes=((4,),), line: int = 10,
       done: bool = True, label: str | None = None) -> Event:
    data = op not in ("barrier", "monitored_barrier")
    return Event(rank=rank, group="0", seq=seq, op=op, reduce_op="SUM" if op == "all_reduce" else None,
                 shapes=tuple(shapes) if data else (), dtypes=("float32",) if data else (), device="cpu" if data else None,
                 root=None, group_ranks=members, t_enter=0.0, t_exit=0.001 if done else None,
                 callsite=SITE.format(line), label=label)


def stalled(traces: dict[int, list[Event]]) -> list:
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=es[-1]) for r, es in traces.items()}
    return analyze(traces, outcomes, RunFacts(world_size=len(traces), end_reason="stall"))


# -- a barrier against a data call ---------------------------------------------


def test_a_barrier_against_a_broadcast_still_waiting_is_a_hang_naming_both_lines():
    # accelerate's wait_for_everyone on rank 1, DDP's forward broadcast on rank 0 (test_distributed_data_loop.py)
    traces = {0: [ev(0, 1), ev(0, 2, "broadcast", line=173, done=False, label="DDP broadcast")],
              1: [ev(1, 1), ev(1, 2, "barrier", line=178, done=False)]}
    [hang] = [f for f in stalled(traces) if f.severity == "error"]
    assert hang.kind == "hang" and not hang.tie
    assert hang.waiting_ranks == (1,) and hang.absent_ranks == (0,)
    assert hang.callsite == SITE.format(178)
    assert {d.rank: d.callsite for d in hang.ranks} == {1: SITE.format(178), 0: SITE.format(173)}
    assert "train.py:173" in hang.summary and "train.py:178" in hang.summary


def test_a_rank_that_skips_monitored_barrier_is_the_one_named_absent():
    members = (0, 1, 2)
    traces = {r: [ev(r, 1, members=members)] for r in members}
    traces[0].append(ev(0, 2, "monitored_barrier", members=members, line=27, done=False))
    traces[2].append(ev(2, 2, "monitored_barrier", members=members, line=27, done=False))
    traces[1].append(ev(1, 2, "all_reduce", members=members, line=28, done=False))
    # two ranks against one: the majority's monitored_barrier, and rank 1 the odd one out at its own line
    [odd] = [f for f in stalled(traces) if f.severity == "error"]
    assert odd.kind == "mismatch" and odd.odd_ranks == (1,) and "op" in odd.fields
    assert odd.op == "monitored_barrier" and odd.callsite == SITE.format(27)
    assert {d.rank: d.callsite for d in odd.ranks}[1] == SITE.format(28)


def test_a_barrier_paired_with_a_data_call_that_completed_is_still_a_mismatch():
    events = {0: ev(0, 1, "barrier"), 1: ev(1, 1, "all_reduce")}
    assert waits_elsewhere(events) is None
    traces = {0: [events[0]], 1: [events[1]]}
    outcomes = {r: RankOutcome(rank=r, state="finished", phase="finished") for r in (0, 1)}
    found = analyze(traces, outcomes, RunFacts(world_size=2))
    assert [f.kind for f in found if f.severity == "error"] == ["mismatch"]


def test_two_data_calls_that_differ_are_a_mismatch_not_a_hang_elsewhere():
    assert waits_elsewhere({0: ev(0, 1, "broadcast", done=False), 1: ev(1, 1, "all_reduce", done=False)}) is None


# -- the files the user named ---------------------------------------------------


def test_a_file_named_on_the_command_line_is_user_code_even_under_site_packages(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages" / "accelerate" / "test_utils"
    site.mkdir(parents=True)
    script, other = site / "test_loop.py", site / "helpers.py"
    script.write_text("")
    other.write_text("")
    monkeypatch.setattr(user_code, "_declared", None)   # restored after the test, whatever declare() sets
    monkeypatch.delenv(user_code.USER_FILES_ENV, raising=False)
    assert classify_file(str(script), torch_dir()) == LIBRARY
    named = user_code.named_paths(["accelerate", "launch", "--num_processes", "2", str(script),
                                   f"--config={tmp_path / 'missing.py'}"], cwd=str(tmp_path))
    assert named == [str(script)]
    before = dict(os.environ)
    user_code.declare(named)
    assert dict(os.environ) == before   # this process's environment is never written (it may be the user's)
    assert user_code.environment(named) == {user_code.USER_FILES_ENV: str(script)}   # what the ranks are given
    assert classify_file(str(script), torch_dir()) == USER
    assert classify_file(str(other), torch_dir()) == LIBRARY   # only what was named


def test_a_test_folder_and_a_pytest_node_id_name_user_code(tmp_path, monkeypatch):
    tests = tmp_path / "site-packages" / "pkg" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_a.py").write_text("")
    monkeypatch.setattr(user_code, "_declared", None)   # restored after the test, whatever declare() sets
    named = user_code.named_paths(["pytest", "-x", str(tests), f"{tests / 'test_a.py'}::test_one"])
    assert named == [str(tests) + os.sep, str(tests / "test_a.py")]
    user_code.declare(named)
    assert classify_file(str(tests / "sub" / "test_b.py"), torch_dir()) == USER


def test_a_folder_that_holds_installed_packages_is_not_user_code():
    import sysconfig
    purelib = sysconfig.get_paths()["purelib"]
    assert user_code.named_paths([purelib, os.path.dirname(purelib)]) == []


# -- DTensor's full_tensor() on one rank ---------------------------------------------

TORCH_SITE = "/opt/py/lib/python3.11/site-packages/torch"
# rank 0's main thread as faulthandler wrote it when gloo aborted it inside full_tensor() (torch 2.13)
FULL_TENSOR_STACK = f"""Fatal Python error: Aborted

Thread 0x00007f6a9e5146c0 (most recent call first):
  File "/opt/distcheck/rank/native.py", line 447 in loop
  File "/opt/py/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f6ac2824b80 (most recent call first):
  File "{TORCH_SITE}/_ops.py", line 1279 in __call__
  File "{TORCH_SITE}/distributed/_functional_collectives.py", line 142 in wait_tensor
  File "{TORCH_SITE}/distributed/_functional_collectives.py", line 1122 in wait
  File "{TORCH_SITE}/distributed/tensor/_redistribute.py", line 1766 in redistribute_local_tensor
  File "{TORCH_SITE}/distributed/tensor/_api.py", line 731 in redistribute
  File "{TORCH_SITE}/distributed/tensor/_api.py", line 774 in full_tensor
  File "/home/u/train.py", line 30 in main
  File "<frozen runpy>", line 88 in _run_code
"""
ABORT = ("[enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 200 vs 176. "
         "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?")


def test_the_functional_collective_a_stack_is_in_is_named_by_the_api_the_user_called():
    frames = [(f.split('"')[1], int(f.split("line ")[1].split()[0]), f.rsplit(" in ", 1)[1])
              for f in FULL_TENSOR_STACK.splitlines() if f.strip().startswith("File") and "torch" in f]
    found = functional_call_in(frames)
    assert (found.api, found.op) == ("DTensor.full_tensor()", "all_gather")
    assert functional_call_in([(f"{TORCH_SITE}/distributed/tensor/_api.py", 774, "full_tensor")]) is None   # no collective
    assert functional_call_in([(f"{TORCH_SITE}/distributed/_functional_collectives.py", 142, "wait_tensor")]).op is None
    assert wire_op("all_gather_into_tensor") == wire_op("all_gather") == "all_gather" != wire_op("all_reduce")


def _full_tensor_on_rank_0(world: int, *, where: str | None = SITE.format(30)):
    members = tuple(range(world))
    traces = {r: [ev(r, 1, members=members, line=26), ev(r, 2, members=members, shapes=((5,),), line=28)]
              for r in members}
    for r in members[1:]:   # the peers' metric all_gather, broken off by the abort ("Connection reset by peer")
        traces[r].append(ev(r, 3, "all_gather_into_tensor", members=members, shapes=((100,),), line=34)
                         ._replace(error="RuntimeError: Connection reset by peer"))
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGABRT", exception=ABORT, stack=FULL_TENSOR_STACK,
                               last_event=traces[0][-1], where=where)}
    outcomes |= {r: RankOutcome(rank=r, state="stuck", last_event=traces[r][-1]) for r in members[1:]}
    return traces, outcomes


def test_a_rank_that_died_in_full_tensor_before_its_record_had_it_is_paired_with_its_peers_by_seq():
    traces, outcomes = _full_tensor_on_rank_0(3, where=None)   # the line from the stack itself
    e = unrecorded_call(outcomes[0], group_table(traces))
    assert is_unrecorded(e) and (e.group, e.seq, e.op, e.group_ranks) == ("0", 3, "all_gather", (0, 1, 2))
    assert e.callsite == SITE.format(30) and not e.completed
    assert with_unrecorded_calls(outcomes, group_table(traces))[1] is outcomes[1]   # peers untouched
    # a crash inside a recorded call, or a stack outside any functional collective: nothing inferred
    inside = dataclasses.replace(outcomes[0], last_event=traces[0][-1]._replace(t_exit=None))
    assert unrecorded_call(inside, group_table(traces)) is None
    assert unrecorded_call(dataclasses.replace(outcomes[0], stack="Fatal Python error: Aborted\n"), group_table(traces)) is None


def test_full_tensor_on_one_rank_aborted_by_gloo_names_that_rank_the_shape_and_its_line():
    traces, outcomes = _full_tensor_on_rank_0(3)
    found = analyze(traces, outcomes, RunFacts(world_size=3, end_reason="crash"))
    errors = [f for f in found if f.severity == "error"]
    assert [f.kind for f in errors] == ["mismatch", "crash"]   # the cause first
    m, crash = errors
    assert m.odd_ranks == (0,) and not m.tie and m.fields == ("shape",)   # all_gather against all_gather: the size
    assert (m.group, m.seq, m.op, m.callsite) == ("0", 3, "all_gather_into_tensor", SITE.format(34))
    lines = {d.rank: d.callsite for d in m.ranks}
    assert lines == {0: SITE.format(30), 1: SITE.format(34), 2: SITE.format(34)}
    assert "DTensor.full_tensor()" in m.summary and "train.py:30" in m.summary and "train.py:34" in m.summary
    assert "cannot be told" not in m.summary
    assert crash.caused_by.seq == 3 and "most likely a consequence" in crash.summary


def test_full_tensor_on_one_of_two_ranks_is_a_tie():
    traces, outcomes = _full_tensor_on_rank_0(2)
    [m] = [f for f in analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash")) if f.kind == "mismatch"]
    assert m.tie and m.odd_ranks == () and {d.rank: d.callsite for d in m.ranks}[0] == SITE.format(30)


def test_full_tensor_recorded_by_the_sidecar_against_an_all_reduce_is_an_op_and_shape_mismatch():
    members = (0, 1, 2)
    traces = {r: [ev(r, 1, members=members)] for r in members}
    traces[0].append(ev(0, 2, "all_gather", members=members, shapes=((8, 11),), line=30, done=False,
                        label="DTensor all_gather")._replace(native=True, reduce_op=None, device=None))
    for r in (1, 2):
        traces[r].append(ev(r, 2, members=members, shapes=((300,),), line=34, done=False))
    [m] = [f for f in stalled(traces) if f.severity == "error"]
    assert m.kind == "mismatch" and m.odd_ranks == (0,) and set(m.fields) == {"op", "shape"}
    assert {d.rank: d.callsite for d in m.ranks}[0] == SITE.format(30)


# -- full_tensor() on rank 0 while its peers' FSDP2 pre-forward all-gathers (issue 41) -------------------
# Every call is issued from C++ and recorded by a polling sidecar: gloo's abort may come before rank 0's
# sidecar wrote anything, while an old call was still open in its record, or after its whole first step.
# The peers' records are whole; their #7 was closed by their own sidecar when they were stopped.

FSDP_STEP = (("all_gather", (27,)), ("all_gather", (9,)), ("all_gather", (9,)), ("all_gather", (27,)),
             ("all_reduce", (27,)), ("all_reduce", (81,)))


def _fsdp(rank: int, seq: int, op: str, shape: tuple, *, done: bool = True, line: int = 34) -> Event:
    return ev(rank, seq, op, members=(0, 1, 2), shapes=(shape,), line=line, done=done,
              label=f"FSDP {op}")._replace(native=True, reduce_op=None, device=None)


def _fsdp_peers_and_rank_0(rank_0_record: list[Event], peer_error: str | None = "RuntimeError: Connection reset by peer"):
    traces = {r: [_fsdp(r, i, op, shape) for i, (op, shape) in enumerate(FSDP_STEP, 1)] + [_fsdp(r, 7, "all_gather", (27,))]
              for r in (1, 2)}   # closed as returned by the peer's sidecar when the peer failed
    traces[0] = rank_0_record
    stack = FULL_TENSOR_STACK.replace("line 30 in main", "line 32 in main")
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGABRT", stack=stack, where=SITE.format(34),
                               exception=ABORT.replace("200 vs 176", "54 vs 48"),
                               last_event=rank_0_record[-1] if rank_0_record else None)}
    outcomes |= {r: RankOutcome(rank=r, state="killed", exception=peer_error, last_event=traces[r][-1]) for r in (1, 2)}
    return traces, outcomes


RANK_0_RECORDS = {   # what rank 0's sidecar had written when gloo aborted it, as seen in real runs
    "empty": [],
    "an old call still open": [_fsdp(0, 1, "all_gather", (27,), done=False)],
    "four calls, the last open": [_fsdp(0, i, op, shape, done=i < 4, line=35)
                                  for i, (op, shape) in enumerate(FSDP_STEP[:4], 1)],
    "the whole first step": [_fsdp(0, i, op, shape, line=32) for i, (op, shape) in enumerate(FSDP_STEP, 1)],
}


def test_full_tensor_against_fsdp2_peers_names_rank_0_at_the_peers_number_whatever_its_sidecar_wrote():
    verdicts = set()
    for name, record in RANK_0_RECORDS.items():
        traces, outcomes = _fsdp_peers_and_rank_0(record)
        found = analyze(traces, outcomes, RunFacts(world_size=3, end_reason="crash"))
        errors = [f for f in found if f.severity == "error"]
        assert [f.kind for f in errors] == ["mismatch", "crash"], (name, [f.summary for f in errors])
        m = errors[0]
        lines = {d.rank: d.callsite for d in m.ranks}
        verdicts.add((m.seq, m.odd_ranks, m.tie, m.fields, m.callsite, tuple(sorted(lines.items()))))
        assert "DTensor.full_tensor()" in m.summary and "cannot be told" not in m.summary, (name, m.summary)
    assert verdicts == {(7, (0,), False, ("shape",), SITE.format(34),
                         ((0, SITE.format(32)), (1, SITE.format(34)), (2, SITE.format(34))))}


def test_a_peer_stopped_by_distcheck_inside_its_fsdp2_call_counts_as_broken_off_there():
    traces, outcomes = _fsdp_peers_and_rank_0([], peer_error=None)   # killed while inside it, no error of its own
    assert unrecorded_call(outcomes[0], group_table(traces), outcomes).seq == 7
    # one peer stopped between its #6 and #7 (its sidecar closed #6 at the end): the others went on past #6
    traces[2] = traces[2][:-1]
    outcomes[2] = dataclasses.replace(outcomes[2], last_event=traces[2][-1])
    assert unrecorded_call(outcomes[0], group_table(traces), outcomes).seq == 7


def test_a_stack_in_full_tensor_is_not_placed_where_the_peers_finished_or_failed_on_their_own():
    traces, outcomes = _fsdp_peers_and_rank_0([])
    table = group_table(traces)
    finished = {r: dataclasses.replace(o, state="finished", exception=None) for r, o in outcomes.items() if r}
    assert unrecorded_call(outcomes[0], table, finished) is None      # the peers returned from every call
    own = {r: dataclasses.replace(o, exception="KeyError: 'lr'") for r, o in outcomes.items() if r}
    assert unrecorded_call(outcomes[0], table, own) is None           # they left #7 and failed elsewhere
    python_open = dataclasses.replace(outcomes[0], last_event=_fsdp(0, 3, "all_gather", (9,), done=False)._replace(native=False))
    assert unrecorded_call(python_open, table, outcomes) is None      # a Python call's record is where the rank was


def test_the_fatal_dump_is_read_from_the_stacks_file_or_else_from_the_rank_log(tmp_path):
    from distcheck.evidence.collect import read_stack_dump
    from distcheck.files.launch_dir import LaunchFiles

    files = LaunchFiles(tmp_path)
    for folder in ("stacks", "logs"):
        (tmp_path / folder).mkdir()
    files.log(0).write_text("rank 0 starting\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                            + FULL_TENSOR_STACK)   # faulthandler on the rank's stderr
    dump = read_stack_dump(files, 0)
    assert dump is not None and dump.fatal and "full_tensor" in dump.text
    files.stacks(0).write_text(FULL_TENSOR_STACK.replace("line 30 in main", "line 31 in main"))
    assert "line 31 in main" in read_stack_dump(files, 0).text   # the stacks file, where it has a dump
    assert read_stack_dump(files, 1) is None


# -- a DeviceMesh group mixed up ---------------------------------------------------

DP, TP = {0: ("1", (0, 2)), 2: ("1", (0, 2)), 1: ("2", (1, 3)), 3: ("2", (1, 3))}, \
    {0: ("3", (0, 1)), 1: ("3", (0, 1)), 2: ("4", (2, 3)), 3: ("4", (2, 3))}
LOSS, ACT = 24, 25


def mesh_ev(rank: int, dim: dict, seq: int, line: int, done: bool = True) -> Event:
    group, members = dim[rank]
    return ev(rank, seq, members=members, line=line, done=done)._replace(group=group)


def _mesh_traces(odd: int | None) -> dict[int, list[Event]]:
    """Each rank: loss over dp, then activations over tp, two steps; ``odd`` takes tp for its loss. Each
    trace ends where the real run's ranks ended (tests/scripts/ecosystem/devicemesh_mixed_groups.py)."""
    if odd is None:
        return {r: [mesh_ev(r, DP, 1, LOSS), mesh_ev(r, TP, 1, ACT), mesh_ev(r, DP, 2, LOSS), mesh_ev(r, TP, 2, ACT)]
                for r in range(4)}
    assert odd == 1
    return {0: [mesh_ev(0, DP, 1, LOSS), mesh_ev(0, TP, 1, ACT), mesh_ev(0, DP, 2, LOSS, done=False)],
            1: [mesh_ev(1, TP, 1, LOSS), mesh_ev(1, TP, 2, ACT, done=False)],
            2: [mesh_ev(2, DP, 1, LOSS), mesh_ev(2, TP, 1, ACT, done=False)],
            3: [mesh_ev(3, DP, 1, LOSS, done=False)]}


def test_a_mesh_dimension_is_one_pattern_on_every_rank():
    assert group_pattern((0, 2)) == group_pattern((1, 3)) == (0, 2) != group_pattern((2, 3))
    assert group_pattern(()) == ()


def test_the_rank_that_used_the_wrong_mesh_dimension_is_named_before_the_cycle():
    traces = _mesh_traces(odd=1)
    assert out_of_step_ranks(traces) == {1: (0, [0, 3])}
    errors = [f for f in stalled(traces) if f.severity == "error"]
    assert [f.kind for f in errors] == ["order", "hang"]
    culprit, cycle = errors
    assert culprit.odd_ranks == (1,) and culprit.callsite == SITE.format(LOSS) and culprit.fields == ("group",)
    assert (culprit.group, culprit.seq) == ("3", 1) and culprit.data["out_of_step"]["expected_group"] == "2"
    assert "Rank 1" in culprit.summary and "train.py:24" in culprit.summary
    assert cycle.waiting_ranks == (0, 1, 2, 3) and cycle.caused_by.ranks == (1,)


DP8 = {r: (str(r % 4 + 1), (r % 4, r % 4 + 4)) for r in range(8)}          # a (2, 4) mesh: "dp" pairs
TP8 = {r: ("5", (0, 1, 2, 3)) if r < 4 else ("6", (4, 5, 6, 7)) for r in range(8)}


def test_at_8_ranks_the_rank_that_used_the_wrong_mesh_dimension_is_still_named():
    """On a (2, 4) mesh the cycle's parts are 3 ranks waiting for 1 in a "tp" group and 1 for 3 in the other, so
    they stay separate hangs (a side outnumbered); the waits still lead round: rank 7 is named before them.
    Each trace ends where the real 8-rank run's ranks ended."""
    traces = {r: [mesh_ev(r, DP8, 1, LOSS), mesh_ev(r, TP8, 1, ACT, done=False)] for r in (0, 1, 2)}
    traces[3] = [mesh_ev(3, DP8, 1, LOSS, done=False)]
    traces.update({r: [mesh_ev(r, DP8, 1, LOSS), mesh_ev(r, TP8, 1, ACT), mesh_ev(r, DP8, 2, LOSS, done=False)]
                   for r in (4, 5, 6)})
    traces[7] = [mesh_ev(7, TP8, 1, LOSS), mesh_ev(7, TP8, 2, ACT, done=False)]
    assert out_of_step_ranks(traces) == {7: (0, [3, 4, 5, 6])}
    errors = [f for f in stalled(traces) if f.severity == "error"]
    assert errors[0].kind == "order" and errors[0].odd_ranks == (7,)
    hangs = errors[1:]
    assert hangs and all(f.kind is Kind.HANG and f.caused_by.ranks == (7,) for f in hangs)


def test_ranks_that_follow_one_mesh_pattern_have_no_rank_out_of_step():
    assert out_of_step_ranks(_mesh_traces(odd=None)) == {}
    outcomes = {r: RankOutcome(rank=r, state="finished", phase="finished") for r in range(4)}
    assert [f for f in analyze(_mesh_traces(odd=None), outcomes, RunFacts(world_size=4)) if f.severity == "error"] == []


def test_a_symmetric_cycle_has_no_rank_out_of_step():
    # two ranks, each in the other's group first: either could be the odd one, so neither is named
    a, b = ("1", (0, 1)), ("2", (0, 1))
    traces = {0: [ev(0, 1, members=a[1], done=False)._replace(group=a[0])],
              1: [ev(1, 1, members=b[1], done=False)._replace(group=b[0])]}
    assert out_of_step_ranks(traces) == {}


def test_full_tensor_against_fsdp2_peers_whose_sidecar_sampled_no_user_line_still_names_rank_0():
    """A C++-issued call's line comes from a stack its sidecar sampled later, so one peer may have none (seen
    beside CPU hogs): the peers still agree on their call, and rank 0 is out of step, never a tie."""
    traces, outcomes = _fsdp_peers_and_rank_0([])
    traces[2][-1] = traces[2][-1]._replace(callsite=None, label="C++-issued all_gather")
    found = analyze(traces, outcomes, RunFacts(world_size=3, end_reason="crash"))
    m = next(f for f in found if f.kind == "mismatch")
    assert m.odd_ranks == (0,) and not m.tie and m.callsite == SITE.format(34)
    assert "cannot be told" not in m.summary and "a tie" not in m.summary


UNPADDING_STACK = FULL_TENSOR_STACK.replace(
    f'''  File "{TORCH_SITE}/_ops.py", line 1279 in __call__
  File "{TORCH_SITE}/distributed/_functional_collectives.py", line 142 in wait_tensor
  File "{TORCH_SITE}/distributed/_functional_collectives.py", line 1122 in wait
  File "{TORCH_SITE}/distributed/tensor/_redistribute.py", line 1766 in redistribute_local_tensor''',
    f'''  File "{TORCH_SITE}/distributed/tensor/_collective_utils.py", line 261 in unpad_tensor
  File "{TORCH_SITE}/distributed/tensor/placement_types.py", line 564 in _maybe_unpad_tensor
  File "{TORCH_SITE}/distributed/tensor/placement_types.py", line 615 in _to_replicate_tensor
  File "{TORCH_SITE}/distributed/tensor/_redistribute.py", line 1651 in redistribute_local_tensor''').replace(
    "line 30 in main", "line 32 in main")


def test_full_tensor_aborted_while_dtensor_unpads_the_gathered_result_is_still_inside_its_all_gather():
    """Seen beside CPU hogs: gloo's abort (on its own thread) finds rank 0's main thread in DTensor's
    redistribution, unpadding the result its lazy wait is still inside: no funcol frame on the stack."""
    assert UNPADDING_STACK != FULL_TENSOR_STACK and "_functional_collectives" not in UNPADDING_STACK
    record = [_fsdp(0, i, op, shape, line=36) for i, (op, shape) in enumerate(FSDP_STEP, 1)]   # its sidecar's
    traces, outcomes = _fsdp_peers_and_rank_0(record)
    outcomes[0] = dataclasses.replace(outcomes[0], stack=UNPADDING_STACK)
    found = analyze(traces, outcomes, RunFacts(world_size=3, end_reason="crash"))
    m = next(f for f in found if f.kind == "mismatch")
    assert (m.seq, m.odd_ranks, m.tie) == (7, (0,), False) and "DTensor.full_tensor()" in m.summary
    assert {d.rank: d.callsite for d in m.ranks}[0] == SITE.format(32)


def test_a_large_meshs_rank_out_of_step_is_found_in_memory_that_grows_with_the_records_not_their_square():
    """At 16,384 ranks node 0's judgement of a pipeline's cycle went from 0.5 to 10 GB: every rank's set of
    peers (a world group in each step: every rank) and a tuple of each call's group pattern per record. 2,048
    ranks here, each step a world all-reduce and a pair's ("a": 0-1, 2-3, ...); rank 7 uses a pair of the
    other dimension ("b": 5-7) once."""
    import tracemalloc

    world = tuple(range(2048))
    dim_a = {r: (f"a{r - r % 2}", (r - r % 2, r - r % 2 + 1)) for r in world}
    dim_b = {r: (f"b{r - r % 4 + r % 2}", (r - r % 4 + r % 2, r - r % 4 + r % 2 + 2)) for r in world}

    def step(rank: int, seq: int, dim: dict) -> list[Event]:
        return [ev(rank, seq, members=world), mesh_ev(rank, dim, seq, LOSS)]

    traces = {r: [e for seq in range(1, 9) for e in step(r, seq, dim_b if (r, seq) == (7, 5) else dim_a)]
              for r in world}
    tracemalloc.start()
    try:
        found = out_of_step_ranks(traces)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert list(found) == [7]
    assert peak < 40e6, f"{peak / 1e6:.0f} MB"   # was 2,048 sets of 2,047 peers and 16 tuples of 2,048 a rank
