"""The pure analysis on hand-built traces: mismatches, crossings, counts, hangs,
crashes, wrong numbers, duplicates and stragglers. No processes, milliseconds each."""

from __future__ import annotations

import time

import pytest

from distcheck.diagnose.rules import (
    RunFacts, analyze, behaved_as_expected, collectives_compared, group_table, majority, observed_kinds,
)
from distcheck.diagnose.duplicates import find_duplicates
from distcheck.diagnose.straggler import find_stragglers
from distcheck.models import Event, Finding, RankOutcome
from distcheck.scenario import ScenarioContext

WORLD4 = (0, 1, 2, 3)
SITE = "/home/u/train.py:{}:evaluate"


def ev(rank: int, seq: int, op: str = "all_reduce", *, group: str = "0", members: tuple[int, ...] = WORLD4,
       reduce_op: str | None = "SUM", shapes=((4,),), dtypes=("float32",), line: int = 10, label: str | None = None,
       t: float = 0.0, done: bool = True, root: int | None = None, error: str | None = None) -> Event:
    return Event(rank=rank, group=group, seq=seq, op=op, reduce_op=reduce_op, shapes=tuple(shapes),
                 dtypes=tuple(dtypes), device="cpu", root=root, group_ranks=members, t_enter=t,
                 t_exit=(t + 0.001) if done else None, error=error, callsite=SITE.format(line), label=label)


def traces_of(*events: Event) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for e in events:
        out.setdefault(e.rank, []).append(e)
    return out


def finished(*ranks: int) -> dict[int, RankOutcome]:
    return {r: RankOutcome(rank=r, state="finished", phase="finished") for r in ranks}


def run(traces, outcomes=None, end="completed", results=None, world=4) -> list[Finding]:
    return analyze(traces, outcomes if outcomes is not None else finished(*range(world)),
                   RunFacts(world_size=world, end_reason=end), results)


def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


# -- majority ------------------------------------------------------------------


def test_majority_states_a_tie_instead_of_picking_a_side():
    assert majority({0: "a", 1: "a", 2: "b"}) == ("a", [2], False)
    assert majority({0: "a", 1: "b"}) == (None, [], True)
    assert majority({0: "a", 1: "a", 2: "b", 3: "b"}) == (None, [], True)
    assert majority({0: "a", 1: "a", 2: "b", 3: "c"}) == ("a", [2, 3], False)


def test_identical_calls_give_no_finding_and_count_as_compared():
    traces = traces_of(*(ev(r, s) for r in WORLD4 for s in (1, 2, 3)))
    assert run(traces) == []
    assert collectives_compared(group_table(traces)) == 3
    assert observed_kinds([]) == ("pass",)


# -- structural mismatch ----------------------------------------------------------


def test_reduce_op_mismatch_names_the_field_the_odd_rank_and_both_callsites():
    traces = traces_of(*(ev(r, 1, reduce_op="MAX" if r == 3 else "SUM", line=24 if r == 3 else 26) for r in WORLD4))
    [f] = run(traces)
    assert f.kind == "mismatch" and f.severity == "error"
    assert f.fields == ("reduce_op",)
    assert f.odd_ranks == (3,) and not f.tie
    assert f.majority["reduce_op"] == "SUM" and f.majority["op"] == "all_reduce"
    assert (f.group, f.seq, f.op) == ("0", 1, "all_reduce")
    sites = {d.rank: (d.role, d.callsite) for d in f.ranks}
    assert sites[3] == ("odd", SITE.format(24))
    assert sites[0] == ("majority", SITE.format(26))
    assert "train.py:24" in f.summary and "train.py:26" in f.summary
    assert "MAX on rank 3" in f.summary and "SUM on ranks 0, 1, 2" in f.summary
    assert f.data["values"] == {"reduce_op": {"SUM": [0, 1, 2], "MAX": [3]}}


def test_a_two_two_split_is_a_tie_and_blames_nobody():
    traces = traces_of(*(ev(r, 1, dtypes=("int64",) if r % 2 else ("float32",)) for r in WORLD4))
    [f] = run(traces)
    assert f.kind == "mismatch" and f.tie
    assert f.odd_ranks == () and f.majority is None
    assert f.fields == ("dtype",)
    assert "tie" in f.summary and "no side has a majority" in f.summary
    assert {d.role for d in f.ranks} == {"tie"}


def test_two_ranks_that_disagree_are_a_tie_whichever_file_is_read_first():
    for order in ((0, 1), (1, 0)):
        traces = {r: [ev(r, 1, members=(0, 1), shapes=((3, 3),) if r == 0 else ((4, 4),))] for r in order}
        [f] = run(traces, finished(0, 1), world=2)
        assert f.tie and f.odd_ranks == () and f.fields == ("shape",)


def test_three_way_split_keeps_the_largest_side_as_majority():
    shapes = {0: ((4,),), 1: ((4,),), 2: ((5,),), 3: ((6,),)}
    [f] = run(traces_of(*(ev(r, 1, shapes=shapes[r]) for r in WORLD4)))
    assert f.odd_ranks == (2, 3) and not f.tie
    assert f.majority["shapes"] == [[4]]
    assert "[5] on rank 2" in f.summary and "[6] on rank 3" in f.summary


def test_three_way_split_without_a_larger_side_is_a_tie():
    members = (0, 1, 2)
    ops = {0: "SUM", 1: "MAX", 2: "MIN"}
    traces = {r: [ev(r, 1, members=members, reduce_op=ops[r])] for r in members}
    [f] = run(traces, finished(*members), world=3)
    assert f.tie and f.odd_ranks == () and f.fields == ("reduce_op",)


def test_every_differing_field_is_listed_in_a_fixed_order():
    traces = traces_of(*(ev(r, 1, shapes=((8,),) if r == 1 else ((4,),), dtypes=("int64",) if r == 1 else ("float32",))
                         for r in WORLD4))
    [f] = run(traces)
    assert f.fields == ("shape", "dtype") and f.odd_ranks == (1,)


def test_a_mismatch_repeated_every_step_is_reported_once_with_its_repeats():
    traces = traces_of(*(ev(r, s, reduce_op="MAX" if r == 3 else "SUM") for r in WORLD4 for s in (1, 2, 3)))
    [f] = run(traces)
    assert f.seq == 1 and f.data["repeated_at"] == [2, 3]
    assert "repeats at 2 later calls (#2, #3)" in f.summary


def test_a_later_divergence_of_another_kind_is_reported_too():
    traces = traces_of(*(ev(r, 1, reduce_op="MAX" if r == 3 else "SUM") for r in WORLD4),
                       *(ev(r, 2, shapes=((2,),) if r == 0 else ((4,),)) for r in WORLD4))
    found = run(traces)
    assert [(f.seq, f.fields, f.odd_ranks) for f in found] == [(1, ("reduce_op",), (3,)), (2, ("shape",), (0,))]


# -- process groups --------------------------------------------------------------


def test_disjoint_subgroups_with_the_same_name_are_not_compared_with_each_other():
    # Ranks 0,1 and ranks 2,3 each run their own subgroup "1" with their own tensor sizes: legitimate.
    traces = traces_of(*(ev(r, 1, group="1", members=(0, 1), shapes=((2,),)) for r in (0, 1)),
                       *(ev(r, 1, group="1", members=(2, 3), shapes=((3,),)) for r in (2, 3)),
                       *(ev(r, 1) for r in WORLD4))
    assert run(traces) == []
    assert set(group_table(traces)) == {("1", (0, 1)), ("1", (2, 3)), ("0", WORLD4)}


def test_a_mismatch_inside_one_subgroup_names_that_group_and_its_ranks():
    traces = traces_of(*(ev(r, 1, group="1", members=(0, 1)) for r in (0, 1)),
                       *(ev(r, 1, group="1", members=(2, 3), reduce_op="MAX" if r == 3 else "SUM") for r in (2, 3)),
                       *(ev(r, s, group="0") for r in WORLD4 for s in (1, 2)))
    [f] = run(traces)
    assert (f.group, f.seq, f.fields, f.tie) == ("1", 1, ("reduce_op",), True)
    assert sorted(d.rank for d in f.ranks) == [2, 3]


def test_ranks_that_disagree_about_a_groups_members_are_a_group_mismatch():
    traces = traces_of(*(ev(r, 1, group="2", members=(0, 1, 2) if r == 2 else (0, 1)) for r in (0, 1, 2)))
    [f] = run(traces, finished(0, 1, 2), world=3)
    assert f.kind == "mismatch" and f.fields == ("group",) and f.odd_ranks == (2,)
    assert f.majority["group_ranks"] == (0, 1)
    assert "[0, 1, 2] on rank 2" in f.summary


def test_groups_are_matched_by_their_own_sequence_numbers():
    # A subgroup call between two world calls does not shift the world's numbering.
    traces = traces_of(*(ev(r, 1) for r in WORLD4), ev(0, 1, group="1", members=(0, 1)),
                       ev(1, 1, group="1", members=(0, 1)), *(ev(r, 2) for r in WORLD4))
    assert run(traces) == []


# -- p2p -------------------------------------------------------------------------


def test_send_and_recv_with_different_buffer_sizes_are_a_mismatch():
    traces = {0: [ev(0, 1, "send", group="p2p:0>1", members=(0, 1), reduce_op=None, root=1, shapes=((4,),))],
              1: [ev(1, 1, "recv", group="p2p:0>1", members=(0, 1), reduce_op=None, root=0, shapes=((8,),))]}
    [f] = run(traces, finished(0, 1), world=2)
    assert f.kind == "mismatch" and f.fields == ("shape",)
    assert {d.rank: d.role for d in f.ranks} == {0: "sender", 1: "receiver"}
    assert "[4] sent by rank 0 vs [8] expected by rank 1" in f.summary


def test_matching_send_and_recv_are_fine():
    traces = {0: [ev(0, 1, "send", group="p2p:0>1", members=(0, 1), reduce_op=None, root=1)],
              1: [ev(1, 1, "recv", group="p2p:0>1", members=(0, 1), reduce_op=None, root=0)]}
    assert run(traces, finished(0, 1), world=2) == []


# -- crossed metrics ----------------------------------------------------------------


def test_crossed_labels_with_the_same_signature_are_an_order_error():
    label = {r: "MulticlassConfusionMatrix.compute" if r == 3 else "BinaryConfusionMatrix.compute" for r in WORLD4}
    traces = traces_of(*(ev(r, s, "all_gather", reduce_op=None, label=label[r], line=40 + r)
                         for r in WORLD4 for s in (1, 2, 3)))
    [f] = run(traces)
    assert f.kind == "order" and f.severity == "error"
    assert f.fields == ("label",) and f.odd_ranks == (3,) and not f.tie
    assert f.majority["label"] == "BinaryConfusionMatrix.compute"
    assert {d.rank: d.label for d in f.ranks}[3] == "MulticlassConfusionMatrix.compute"
    assert {d.rank: d.callsite for d in f.ranks}[3] == SITE.format(43)
    assert "BinaryConfusionMatrix.compute on ranks 0, 1, 2 meets MulticlassConfusionMatrix.compute on rank 3" in f.summary
    assert f.data["repeated_at"] == [2, 3]


def test_same_label_from_different_lines_is_ordinary_code_not_an_error():
    # if rank == 0: broadcast(a) else: broadcast(b)
    traces = traces_of(*(ev(r, 1, "broadcast", reduce_op=None, root=0, label="Trainer.fit", line=5 if r == 0 else 7)
                         for r in WORLD4))
    assert run(traces) == []


def test_a_structural_difference_is_a_mismatch_not_an_order_error():
    traces = traces_of(*(ev(r, 1, label="A.compute" if r else "B.compute", shapes=((2,),) if r else ((3,),))
                         for r in WORLD4))
    assert kinds(run(traces)) == ["mismatch"]


# -- counts ------------------------------------------------------------------------


def test_a_rank_that_issued_an_extra_collective_is_a_count_finding():
    # async: it returned without its peers, and none ever joined it
    extra = ev(3, 3, "barrier", reduce_op=None, line=99, label="Logger.log")._replace(async_op=True)
    traces = traces_of(*(ev(r, s) for r in WORLD4 for s in (1, 2)), extra)
    [f] = run(traces)
    assert f.kind == "count" and f.fields == ("count",)
    assert f.odd_ranks == (3,) and f.majority == {"count": 2}
    assert f.data["counts"] == {"0": 2, "1": 2, "2": 2, "3": 3}
    d3 = {d.rank: d for d in f.ranks}[3]
    assert (d3.op, d3.seq, d3.label, d3.callsite) == ("barrier", 3, "Logger.log", SITE.format(99))
    assert "barrier #3 Logger.log at" in f.summary and "train.py:99" in f.summary


def test_a_completed_job_whose_records_disagree_is_distchecks_coverage_warning_not_a_count_error():
    # every rank finished and every call returned: a blocking call returns only once all members entered it
    traces = traces_of(*(ev(r, s) for r in WORLD4 for s in (1, 2, 3) if not (r == 2 and s == 2)))
    [f] = run(traces)
    assert (f.kind, f.severity, f.odd_ranks) == ("coverage", "warning", (2,))
    assert f.data["missing"] == {"2": [2]} and "rank 2 lacks #2" in f.summary
    assert behaved_as_expected(("pass",), observed_kinds([f]))


def test_a_count_split_two_two_is_a_tie():
    traces = traces_of(*(ev(r, s)._replace(async_op=s == 2) for r in WORLD4 for s in ((1, 2) if r < 2 else (1,))))
    [f] = run(traces)
    assert f.kind == "count" and f.tie and f.odd_ranks == () and f.majority is None


def test_counts_are_not_reported_when_a_hang_explains_them():
    traces = traces_of(*(ev(r, s, done=not (s == 2)) for r in (0, 1, 2) for s in (1, 2)), ev(3, 1))
    assert kinds(run(traces, {**finished(3)}, end="stall")) == ["hang"]


# -- hangs, early ends, crashes ------------------------------------------------------


def test_a_rank_whose_trace_ends_early_is_absent_from_the_hang():
    traces = traces_of(*(ev(r, s, done=s < 3) for r in (0, 1, 2) for s in (1, 2, 3)), ev(3, 1), ev(3, 2))
    [f] = run(traces, {3: RankOutcome(rank=3, state="finished", phase="finished")}, end="stall")
    assert f.kind == "hang" and (f.seq, f.op) == (3, "all_reduce")
    assert f.waiting_ranks == (0, 1, 2) and f.absent_ranks == (3,)
    assert "rank 3 never entered it (finished, now idle)" in f.summary


def test_a_rank_without_any_status_is_described_by_where_its_trace_ends():
    traces = traces_of(*(ev(r, s, done=s < 3) for r in (0, 1) for s in (1, 2, 3)), ev(2, 1), ev(2, 2))
    members = (0, 1, 2)
    traces = {r: [e.__class__(**{**e.to_dict(), "group_ranks": members, "shapes": e.shapes,
                                 "dtypes": e.dtypes}) for e in es] for r, es in traces.items()}
    [f] = run(traces, {}, end="stall", world=3)
    assert f.absent_ranks == (2,)
    assert "its trace ends after all_reduce #2 (group 0)" in f.summary


def test_gloo_abort_inside_a_mismatched_collective_is_a_consequence_of_the_mismatch():
    # auroc_empty_rank: the empty rank's placeholder is float32; gloo SIGABRTs rank 3 inside all_gather #6.
    calls = [("barrier", (), ()), ("all_gather", ((1,),), ("int64",)), ("all_gather", ((8,),), ("float32",)),
             ("barrier", (), ()), ("all_gather", ((1,),), ("int64",))]
    events = [ev(r, i + 1, op, reduce_op=None, shapes=s, dtypes=d, label="BinaryAUROC.compute")
              for r in WORLD4 for i, (op, s, d) in enumerate(calls)]
    events += [ev(r, 6, "all_gather", reduce_op=None, shapes=((8,),), dtypes=("float32",) if r == 3 else ("int64",),
                  label="BinaryAUROC.compute", done=False) for r in WORLD4]
    traces = traces_of(*events)
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=traces[r][-1]) for r in (0, 1, 2)}
    outcomes[3] = RankOutcome(rank=3, state="crashed", signal="SIGABRT", last_event=traces[3][-1],
                              where=SITE.format(10))
    found = run(traces, outcomes, end="crash")
    assert kinds(found) == ["mismatch", "crash"]
    mismatch, crash = found
    assert (mismatch.seq, mismatch.op, mismatch.fields, mismatch.odd_ranks) == (6, "all_gather", ("dtype",), (3,))
    assert crash.data["root_rank"] == 3 and crash.caused_by.seq == 6
    assert "killed by SIGABRT inside all_gather #6 (group 0)" in crash.summary
    assert "most likely a consequence of the dtype mismatch" in crash.summary
    assert behaved_as_expected(("mismatch",), observed_kinds(found))


def test_a_hang_inside_a_mismatched_collective_points_at_the_mismatch():
    traces = traces_of(*(ev(r, 1, shapes=((3, 3),) if r < 3 else ((4, 4),), done=False) for r in WORLD4))
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=traces[r][0]) for r in WORLD4}
    found = run(traces, outcomes, end="stall")
    assert kinds(found) == ["mismatch", "hang"]
    assert "shape mismatch in this very call" in found[1].summary


def test_a_raised_exception_is_the_root_cause_and_the_peers_are_described():
    traces = traces_of(*(ev(r, s, done=not (s == 4 and r < 3)) for r in WORLD4 for s in (1, 2, 3, 4) if (r, s) != (3, 4)))
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=traces[r][-1]) for r in (0, 1, 2)}
    outcomes[3] = RankOutcome(rank=3, state="crashed", exception="ValueError: corrupt sample in batch 3",
                              where=SITE.format(17), last_event=traces[3][-1], exit_code=1)
    [crash] = run(traces, outcomes, end="crash")
    assert crash.kind == "crash" and crash.data["root_rank"] == 3
    assert crash.summary.startswith("Rank 3 raised ValueError: corrupt sample in batch 3 at")
    assert "train.py:17" in crash.summary
    assert "ranks 0, 1, 2 waiting in all_reduce #4 (group 0)" in crash.summary
    assert crash.caused_by is None and "caused_by" not in crash.to_dict()["data"]



def _timed_out(traces, outcomes, world=4) -> list[Finding]:
    return analyze(traces, outcomes, RunFacts(world_size=world, end_reason="timeout", timeout_s=8))


def test_a_timeout_with_a_traced_open_call_is_the_stall_reports_hang():
    traces = traces_of(*(ev(r, 1) for r in WORLD4), ev(0, 2, "barrier", reduce_op=None, shapes=(), dtypes=(), done=False))
    outcomes = {0: RankOutcome(rank=0, state="stuck", phase="running", last_event=traces[0][-1]), **finished(1, 2, 3)}
    [hang] = _timed_out(traces, outcomes)
    assert (hang.kind, hang.op, hang.seq, hang.waiting_ranks, hang.absent_ranks) == ("hang", "barrier", 2, (0,), (1, 2, 3))


def test_a_timeout_names_the_waiting_and_absent_sides_of_the_call_a_rank_is_stuck_in():
    # The trace shows every call completed (the open one was never written), but rank 0's status says where it is.
    traces = traces_of(*(ev(r, 1) for r in WORLD4))
    stuck_in = ev(0, 2, "barrier", reduce_op=None, shapes=(), dtypes=(), line=12, done=False)
    outcomes = {0: RankOutcome(rank=0, state="stuck", phase="running", last_event=stuck_in, where=SITE.format(12)),
                **finished(1, 2),
                3: RankOutcome(rank=3, state="running", phase="running", where=SITE.format(30), last_event=traces[3][-1])}
    [hang] = _timed_out(traces, outcomes)
    assert (hang.op, hang.seq, hang.group, hang.callsite) == ("barrier", 2, "0", SITE.format(12))
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2, 3)
    assert hang.summary.startswith("The run did not finish within its --timeout of 8 s: rank 0 is waiting in barrier #2")
    assert "ranks 1, 2 never entered it (finished, now idle)" in hang.summary
    assert "rank 3 never entered it (running outside any collective at /home/u/train.py:30)" in hang.summary
    assert {d.rank: d.role for d in hang.ranks} == {0: "waiting", 1: "absent", 2: "absent", 3: "absent"}


def test_a_rank_busy_in_user_code_at_the_timeout_is_absent_not_waiting():
    traces = traces_of(*(ev(r, 1) for r in WORLD4))
    outcomes = {**finished(0, 2, 3),
                1: RankOutcome(rank=1, state="running", phase="running", where=SITE.format(7), last_event=traces[1][-1])}
    [hang] = _timed_out(traces, outcomes)
    assert hang.kind == "hang" and hang.waiting_ranks == () and hang.absent_ranks == (1,)
    assert hang.op is None and hang.seq is None
    assert hang.summary == ("The run did not finish within its --timeout of 8 s and no rank was waiting in a "
                            "collective: rank 1 running outside any collective at /home/u/train.py:7; "
                            "ranks 0, 2, 3 finished.")
    [d] = hang.ranks
    assert (d.rank, d.role, d.where) == (1, "absent", SITE.format(7))


def test_a_timeout_names_busy_ranks_outside_the_stuck_subgroup_separately():
    pair = (0, 1)
    traces = traces_of(*(ev(r, 1) for r in WORLD4))
    stuck_in = ev(0, 1, group="pair", members=pair, line=20, done=False)
    outcomes = {0: RankOutcome(rank=0, state="stuck", phase="running", last_event=stuck_in), **finished(1, 3),
                2: RankOutcome(rank=2, state="running", phase="running", where=SITE.format(40))}
    in_pair, outside = _timed_out(traces, outcomes)
    assert (in_pair.group, in_pair.waiting_ranks, in_pair.absent_ranks) == ("pair", (0,), (1,))
    assert (outside.waiting_ranks, outside.absent_ranks) == ((), (2,))
    assert "rank 2 running outside any collective at /home/u/train.py:40" in outside.summary

@pytest.mark.parametrize("oom_kills, says", [
    (2, "The kernel's OOM killer sent that SIGKILL: the memory cgroup distcheck runs in counted 2 OOM kills"),
    (0, "distcheck did not send that SIGKILL, and the memory cgroup it runs in counted no OOM kill"),
    (None, "distcheck did not send that SIGKILL; the kernel's OOM killer is the usual sender (see dmesg)"),
])
def test_a_sigkill_says_what_the_oom_counter_says_and_the_memory_last_seen(oom_kills, says):
    traces = traces_of(*(ev(r, s, done=not (s == 2 and r == 0)) for r in (0, 1) for s in (1, 2) if (r, s) != (1, 2)))
    outcomes = {0: RankOutcome(rank=0, state="stuck", last_event=traces[0][-1]),
                1: RankOutcome(rank=1, state="crashed", signal="SIGKILL", exit_code=-9, last_event=traces[1][-1],
                               rss_bytes=3 * 2**30, peak_rss_bytes=5 * 2**30)}
    [crash] = analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash", oom_kills=oom_kills))
    assert says in crash.summary
    assert crash.summary.endswith("rank 1 was last seen using 3.0 GiB resident (peak 5.0 GiB).")
    assert crash.data["oom_kills"] == oom_kills and crash.data["peak_rss_bytes"] == 5 * 2**30


def test_when_the_oom_killer_killed_twice_the_rank_that_ate_the_memory_is_the_root():
    traces = traces_of(ev(0, 1), ev(1, 1))
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGKILL", exit_code=-9, last_event=traces[0][-1],
                               rss_bytes=250 * 2**20, peak_rss_bytes=250 * 2**20),
                1: RankOutcome(rank=1, state="crashed", signal="SIGKILL", exit_code=-9, last_event=traces[1][-1],
                               rss_bytes=1 * 2**30, peak_rss_bytes=int(1.3 * 2**30))}
    [crash] = analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash", oom_kills=2))
    assert crash.data["root_rank"] == 1
    assert crash.summary.startswith("Rank 1 was killed by SIGKILL") and "rank 0 failed the same way" in crash.summary
    [plain] = analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash", oom_kills=0))
    assert plain.data["root_rank"] == 0      # no OOM kill counted: memory says nothing about who came first


# -- wrong numbers -------------------------------------------------------------------


def _ctx(rank: int = 0) -> ScenarioContext:
    return ScenarioContext(rank=rank, world_size=4, local_rank=rank, backend="gloo", device="cpu", seed=0)


def test_numeric_names_the_entries_rows_and_total_and_duplicates_explain_them():
    import torch

    reference = torch.tensor([[2, 1, 1], [0, 2, 0], [1, 0, 3]])
    actual = reference.clone()
    actual[0, 2] += 1
    actual[2, 2] += 1
    results = {}
    for r, ids in enumerate(([0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1])):
        ctx = _ctx(r)
        ctx.check_close("confusion matrix", actual, reference)
        ctx.record_samples(ids, dataset_size=10, dataset="eval set")
        results[r] = ctx.results()
    found = run({}, results=results)
    assert kinds(found) == ["numeric", "duplicates"]
    numeric, dup = found
    assert "2 entries of 9 off" in numeric.summary
    assert "[0, 2] is 2 instead of 1 (+1)" in numeric.summary and "[2, 2] is 4 instead of 3 (+1)" in numeric.summary
    assert "row 0 sums to 5 instead of 4" in numeric.summary and "the grand total is 12 instead of 10" in numeric.summary
    assert "2 samples (ids 0, 1) were counted twice" in numeric.summary
    assert [d["index"] for d in numeric.data["differing"]] == [[0, 2], [2, 2]]
    assert "DistributedSampler padded 10 samples to 12 for 4 ranks" in dup.summary
    assert "id 0 (ranks 0, 2), id 1 (ranks 1, 3)" in dup.summary
    assert dup.data["duplicated"] == {"0": [0, 2], "1": [1, 3]} and dup.data["missing"] == []


def test_a_scalar_numeric_difference_reads_as_value_instead_of_reference():
    ctx = _ctx()
    ctx.check_close("accuracy", 0.625, 0.55, note="Sum the counts instead.")
    [f] = run({}, results={0: ctx.results()})
    assert "'accuracy' differs from the single-process reference on rank 0: 0.625 instead of 0.55." in f.summary
    assert f.summary.endswith("Sum the counts instead.")


def test_passing_numeric_checks_give_no_finding():
    ctx = _ctx()
    ctx.check_close("accuracy", 0.5, 0.5)
    ctx.record_samples(range(10), dataset_size=10)
    assert run({}, results={0: ctx.results()}) == []


def _samples(per_rank: dict[int, list[int]], size: int, world: int = 4) -> list[Finding]:
    results = {r: {"samples": [{"dataset": "eval", "dataset_size": size, "ids": ids}]} for r, ids in per_rank.items()}
    return find_duplicates(results, world)


def test_unsharded_data_says_every_rank_evaluated_the_same_samples():
    [f] = _samples({r: list(range(8)) for r in WORLD4}, size=32)
    assert "every rank evaluated the same 8 samples (ids 0-7)" in f.summary
    assert "8 samples (ids 0-7) were counted 4 times" in f.summary
    assert "24 samples (ids 8-31) were never seen" in f.summary
    assert f.data["same_on_every_rank"] and f.data["missing"] == list(range(8, 32))


def test_drop_last_is_named_when_samples_are_only_missing():
    [f] = _samples({0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}, size=10)
    assert "DistributedSampler(drop_last=True) dropped 2 samples" in f.summary
    assert "2 samples (ids 8, 9) were never seen" in f.summary


def test_a_rank_with_no_samples_still_counts_for_the_padding_arithmetic():
    # 3 samples on 4 ranks, padded to 4: the sampler hands rank 3 a repeat of sample 0.
    [f] = _samples({0: [0], 1: [1], 2: [2], 3: [0]}, size=3)
    assert "padded 3 samples to 4 for 4 ranks" in f.summary


# -- stragglers ------------------------------------------------------------------------


def _timed(lag_of: dict[int, float], steps: int = 8) -> dict[int, list[Event]]:
    events = []
    for s in range(1, steps + 1):
        start = s * 1.0
        events += [ev(r, s, t=start + lag_of.get(r, 0.001 * r)) for r in WORLD4]
    return traces_of(*events)


def test_a_rank_late_into_every_collective_is_a_straggler_with_its_lag():
    [f] = find_stragglers(group_table(_timed({3: 0.2})), RunFacts(world_size=4))
    assert f.kind == "straggler" and f.severity == "warning" and f.odd_ranks == (3,)
    assert f.data["last_in"] == 8 and f.data["collectives"] == 8
    assert f.data["median_lag_s"] == pytest.approx(0.2, abs=0.01)
    assert "Rank 3 was the last to enter 8 of 8 collectives" in f.summary


def test_scheduling_noise_is_not_a_straggler():
    assert find_stragglers(group_table(_timed({3: 0.02})), RunFacts(world_size=4)) == []


def test_a_rank_late_only_now_and_then_is_not_a_straggler():
    events = []
    for s in range(1, 9):
        late = 3 if s % 2 else 2
        events += [ev(r, s, t=s + (0.3 if r == late else 0.0)) for r in WORLD4]
    assert find_stragglers(group_table(traces_of(*events)), RunFacts(world_size=4)) == []


def test_too_few_collectives_are_not_judged():
    assert find_stragglers(group_table(_timed({3: 0.5}, steps=4)), RunFacts(world_size=4)) == []


def test_a_straggler_is_a_warning_that_a_pass_scenario_tolerates():
    # Late is not wrong: a healthy job that waited for a slow rank still passes, with the warning shown.
    found = run(_timed({1: 0.3}))
    assert kinds(found) == ["straggler"] and found[0].severity == "warning"
    assert behaved_as_expected(("pass",), observed_kinds(found))
    assert behaved_as_expected(("straggler",), observed_kinds(found))
    assert not behaved_as_expected(("pass",), ("straggler", "mismatch"))


def _late_arrival(wait_s: float, busy_at: str | None = "/home/u/eval.py:7:main"):
    """Rank 1 enters barrier #1 at t=0; rank 0 arrives ``wait_s`` later (it was busy)."""
    traces = {0: [ev(0, 1, "barrier", reduce_op=None, shapes=(), dtypes=(), t=wait_s, members=(0, 1))],
              1: [ev(1, 1, "barrier", reduce_op=None, shapes=(), dtypes=(), t=0.0, members=(0, 1))]}
    outcomes = {0: RankOutcome(rank=0, state="finished", busy_at=busy_at), 1: RankOutcome(rank=1, state="finished")}
    return analyze(traces, outcomes, RunFacts(world_size=2, stall_timeout_s=10.0))


def test_a_rank_late_by_a_stall_timeout_is_a_straggler_warning_naming_where_it_was_busy():
    [f] = _late_arrival(12.0)
    assert (f.kind, f.severity, f.op, f.seq) == ("straggler", "warning", "barrier", 1)
    assert f.waiting_ranks == (1,) and f.odd_ranks == (0,)
    assert f.summary.startswith("Rank 1 waited 12.0 s in barrier #1 (group 0) for rank 0 (its main thread at ")
    assert "eval.py:7" in f.summary and f.data["busy_at"] == "/home/u/eval.py:7:main"
    assert behaved_as_expected(("pass",), observed_kinds([f]))


def test_a_wait_shorter_than_the_stall_timeout_is_not_reported():
    assert _late_arrival(9.0) == []


# -- expectations and the JSON shape ---------------------------------------------------


def test_expected_kinds_must_all_be_observed_and_extra_consequences_are_allowed():
    assert behaved_as_expected(("mismatch",), ("crash", "mismatch"))
    assert not behaved_as_expected(("duplicates", "numeric"), ("duplicates",))
    assert not behaved_as_expected(("pass",), ("numeric",))
    assert behaved_as_expected(("pass",), ("pass",))


def test_mismatch_findings_round_trip_through_json_with_the_contract_fields():
    traces = traces_of(*(ev(r, 1, reduce_op="MAX" if r == 3 else "SUM", label="Loss.forward") for r in WORLD4))
    [f] = run(traces)
    d = f.to_dict()
    assert d["fields"] == ["reduce_op"] and d["odd_ranks"] == [3] and d["majority"]["reduce_op"] == "SUM"
    assert all(r["label"] == "Loss.forward" and r["callsite"] for r in d["ranks"])
    assert Finding.from_dict(d) == f


def test_a_thousand_ranks_are_analysed_quickly_and_the_odd_one_is_found():
    world = tuple(range(1024))
    traces = {r: [ev(r, s, members=world, reduce_op="MAX" if (r, s) == (517, 40) else "SUM", t=s)
                  for s in range(1, 51)] for r in world}
    t0 = time.perf_counter()
    found = analyze(traces, finished(*world), RunFacts(world_size=1024))
    assert time.perf_counter() - t0 < 5
    [f] = found
    assert (f.seq, f.odd_ranks, f.fields) == (40, (517,), ("reduce_op",))


def test_wrong_numbers_next_to_crossed_calls_name_the_crossing():
    label = {r: "MulticlassConfusionMatrix.compute" if r == 3 else "BinaryConfusionMatrix.compute" for r in WORLD4}
    traces = traces_of(*(ev(r, 1, "barrier", reduce_op=None, shapes=(), dtypes=(), label=label[r]) for r in WORLD4))
    ctx = _ctx()
    ctx.check_close("spam confusion matrix", [[9, 8], [7, 12]], [[11, 11], [13, 13]])
    found = run(traces, results={0: ctx.results()})
    assert kinds(found) == ["order", "numeric"]
    assert "Likely reason: collectives of different metrics/modules were crossed from barrier #1 (group 0)" \
        in found[1].summary


def test_a_tie_names_no_sides_call_site_at_the_top_level():
    traces = traces_of(*(ev(r, 1, reduce_op="MAX" if r else "SUM", line=24 if r else 26, label="Loss.forward")
                         for r in (0, 1)))
    traces = {r: [Event(**{**e.to_dict(), "group_ranks": (0, 1), "shapes": e.shapes, "dtypes": e.dtypes})
                  for e in es] for r, es in traces.items()}
    [f] = run(traces, finished(0, 1), world=2)
    assert f.tie and f.callsite is None and f.label == "Loss.forward" and f.op == "all_reduce"
    assert {d.rank: d.callsite for d in f.ranks} == {0: SITE.format(26), 1: SITE.format(24)}


def test_a_repeated_p2p_buffer_difference_is_reported_once():
    send = [ev(0, s, "send", group="p2p:0>1", members=(0, 1), reduce_op=None, root=1, shapes=((4,),)) for s in (1, 2)]
    recv = [ev(1, s, "recv", group="p2p:0>1", members=(0, 1), reduce_op=None, root=0, shapes=((8,),)) for s in (1, 2)]
    [f] = run({0: send, 1: recv}, finished(0, 1), world=2)
    assert f.seq == 1 and f.data["repeated_at"] == [2]


def test_every_rank_failing_the_same_way_is_said_once():
    # cpu_state_on_nccl: every rank's metric sync hands CPU tensors to an NCCL-only group.
    error = "RuntimeError: No backend type associated with device type cpu"
    traces = traces_of(*(ev(r, 1, "all_gather", reduce_op=None, error=error) for r in WORLD4))
    outcomes = {r: RankOutcome(rank=r, state="crashed", exception=error, exit_code=1, where=SITE.format(17),
                               last_event=traces[r][0]) for r in WORLD4}
    [f] = run(traces, outcomes, end="crash")
    assert f.data["root_rank"] == 0
    assert f.summary == (f"Rank 0 raised {error} inside all_gather #1 (group 0) at /home/u/train.py:17; "
                         f"ranks 1, 2, 3 failed the same way.")


def test_a_large_result_counts_every_differing_entry_but_lists_a_few():
    import torch

    ctx = _ctx()
    ctx.check_close("logits", torch.ones(100, 10), torch.zeros(100, 10))
    [f] = run({}, results={0: ctx.results()})
    assert "1000 entries of 1000 off" in f.summary and len(f.data["differing"]) == 50
    assert f.summary.count(" instead of ") == 8


# -- calls issued from C++ (DDP, FSDP2, functional collectives) ------------------------------


def _native(e: Event, **changes) -> Event:
    """``e`` as the rank's sidecar records a C++-issued call: no reduce op, device or root known."""
    return e._replace(reduce_op=None, device=None, root=None, native=True, **changes)


def test_a_cpp_issued_call_matches_a_python_one_on_what_the_recorder_knows():
    traces = traces_of(*(ev(r, 1) if r else _native(ev(r, 1), label="DDP gradient all_reduce") for r in WORLD4))
    assert run(traces) == []
    traces = traces_of(*(ev(r, 1) if r else _native(ev(r, 1), shapes=((5,),)) for r in WORLD4))
    [f] = run(traces)
    assert f.kind == "mismatch" and f.fields == ("shape",) and f.odd_ranks == (0,)


def test_cpp_issued_calls_are_never_an_order_error_and_unknown_ops_are_not_compared():
    labels = ("DDP init broadcast", "autograd broadcast", "C++-issued broadcast", "DDP broadcast")
    traces = traces_of(*(_native(ev(r, 1, "broadcast"), label=labels[r]) for r in WORLD4))
    assert run(traces) == []
    traces = traces_of(*(_native(ev(r, 1), op="?", shapes=()) if r == 2 else _native(ev(r, 1)) for r in WORLD4))
    assert run(traces) == []


def test_a_hang_in_a_cpp_issued_call_names_what_issued_it_and_the_users_line():
    steps = {r: [_native(ev(r, s, t=s)) for s in range(1, 8)] for r in WORLD4}   # 7 calls every rank made
    traces = {**steps, 0: steps[0] + [_native(ev(0, 8, t=8, done=False, line=13),
                                              label="DDP gradient all_reduce, bucket of 5 elements")]}
    [f] = analyze(traces, {0: RankOutcome(rank=0, state="stuck"), **finished(1, 2, 3)},
                  RunFacts(world_size=4, end_reason="stall"))
    assert (f.kind, f.op, f.seq, f.waiting_ranks, f.absent_ranks) == ("hang", "all_reduce", 8, (0,), (1, 2, 3))
    assert "DDP gradient all_reduce, bucket of 5 elements" in f.summary and ":13" in f.summary


def test_joins_shadow_calls_match_any_label():
    label = {0: "DistributedDataParallel.forward", 1: "Join (DistributedDataParallel._check_global_requires_backward_grad_sync)"}
    traces = traces_of(*(ev(r, 1, members=(0, 1), label=label[r]) for r in (0, 1)))
    assert run(traces) == []


# -- issue 17: splits, group members, the backend's words, findings that agree ---------------


def _a2a(rank: int, sent, received, seq: int = 1) -> Event:
    return ev(rank, seq, "all_to_all_single", reduce_op=None, shapes=())._replace(
        splits=(tuple(sent), tuple(received)))


def test_all_to_all_split_sizes_that_do_not_pair_up_name_each_pair_and_the_odd_rank():
    # Rank 3 sends 320 elements to each peer and expects 320 back; every peer sends and expects 128.
    traces = traces_of(*[_a2a(r, [128] * 4, [128] * 4) for r in range(3)],
                       _a2a(3, [320] * 4, [320] * 4))
    [m] = run(traces)
    assert (m.kind, m.fields, m.odd_ranks, m.tie, m.op) == ("mismatch", ("splits",), (3,), False, "all_to_all_single")
    pairs = {(p["src"], p["dst"]): (p["sent"], p["expected"]) for p in m.data["pairs"]}
    assert pairs == {(3, 0): (320, 128), (3, 1): (320, 128), (3, 2): (320, 128),
                     (0, 3): (128, 320), (1, 3): (128, 320), (2, 3): (128, 320)}
    assert "rank 3 sends 320 elements to rank 0, which expects 128" in m.summary


def test_uneven_splits_that_pair_up_are_clean_and_two_ranks_are_a_tie():
    # Uneven but consistent: rank i sends i+j+1 to j, and j expects exactly that from i.
    traces = traces_of(*[_a2a(i, [i + j + 1 for j in range(4)], [j + i + 1 for j in range(4)]) for i in range(4)])
    assert run(traces) == []
    two = traces_of(_a2a(0, [1, 2], [1, 5], ), _a2a(1, [3, 4], [2, 4]))
    for e in two.values():
        e[0] = e[0]._replace(group_ranks=(0, 1))
    [m] = run(two, world=2)
    assert m.fields == ("splits",) and m.tie and m.odd_ranks == ()


def test_new_group_called_with_different_members_names_each_side_and_its_line():
    traces = traces_of(*[ev(r, 1, "new_group", group="new_group", reduce_op=None, shapes=(), dtypes=(),
                            line=10 if r < 3 else 13)._replace(members=(0, 1) if r < 3 else WORLD4)
                         for r in range(4)])
    [m] = run(traces)
    assert (m.fields, m.odd_ranks) == (("members",), (3,))
    assert m.data["values"]["members"] == {"[0, 1]": [0, 1, 2], "[0, 1, 2, 3]": [3]}
    assert "train.py:10" in m.summary and "train.py:13" in m.summary and "creation order" in m.summary


ABORT = ("[enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 388 vs 4. "
         "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?")


def test_gloo_size_abort_becomes_a_mismatch_that_blames_the_sender_by_size_never_the_receiver():
    recv = ev(0, 3, "recv", group="p2p:any>0", members=(0,), reduce_op=None, shapes=((1,),), done=False)
    sends = [ev(r, 1, "send", group=f"p2p:{r}>0", members=(r, 0), reduce_op=None, root=0,
                shapes=((97,) if r == 3 else (1,),)) for r in (1, 2, 3)]
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGABRT", exception=ABORT, last_event=recv),
                **finished(1, 2, 3)}
    found = run(traces_of(recv, *sends), outcomes, end="crash")
    [m] = [f for f in found if f.kind == "mismatch"]
    assert (m.fields, m.odd_ranks, m.seq, m.op) == (("bytes",), (3,), 3, "recv")
    assert m.data["receivers"] == {"0": {"received": 388, "expected": 4}}
    assert "rank 0 received 388 bytes where it expected 4" in m.summary
    [c] = [f for f in found if f.kind == "crash"]
    assert c.caused_by.fields == ("bytes",) and "SIGABRT" in c.summary


def test_gloo_abort_explained_by_fingerprints_adds_no_second_mismatch():
    a = [ev(r, 1, shapes=((4,),) if r < 3 else ((97,),), done=r != 0) for r in range(4)]
    outcomes = {0: RankOutcome(rank=0, state="crashed", signal="SIGABRT", exception=ABORT, last_event=a[0]),
                **{r: RankOutcome(rank=r, state="stuck", last_event=a[r]) for r in (1, 2, 3)}}
    found = run(traces_of(*a), outcomes, end="crash")
    assert [f.fields for f in found if f.kind == "mismatch"] == [("shape",)]


def test_a_second_finding_that_puts_a_rank_elsewhere_than_its_outcome_is_dropped():
    # Ranks 0, 1 are stuck in new_group #2; rank 2 passed it and waits in all_reduce #1 (group 0).
    ng = [ev(r, s, "new_group", group="new_group", members=(0, 1, 2), reduce_op=None, shapes=(), dtypes=(),
             done=not (s == 2 and r < 2)) for r in range(3) for s in (1, 2)]
    ar = ev(2, 1, members=(0, 1, 2), done=False)
    outcomes = {r: RankOutcome(rank=r, state="stuck", last_event=ng[2 * r + 1]) for r in (0, 1)}
    outcomes[2] = RankOutcome(rank=2, state="stuck", last_event=ar)
    found = run(traces_of(*ng, ar), outcomes, end="stall", world=3)
    hangs = [f for f in found if f.kind == "hang"]
    assert hangs, found
    for f in found[1:]:
        for r in f.waiting_ranks:
            e = outcomes[r].last_event
            assert (e.group, e.seq, e.op) == (f.group, f.seq, f.op), f.summary


def test_send_send_is_one_cycle_finding_and_one_rank_against_many_stays_the_odd_one_out():
    send = lambda r, peer: Event(rank=r, group=f"p2p:{r}>{peer}", seq=1, op="send", reduce_op=None, shapes=((4,),),  # noqa: E731
                                 dtypes=("float32",), device="cpu", root=peer, group_ranks=(r, peer), t_enter=0.0,
                                 t_exit=None, error=None, callsite=SITE.format(5))
    stuck = {r: RankOutcome(rank=r, state="stuck", phase="running", last_event=send(r, 1 - r)) for r in (0, 1)}
    [f] = run({0: [send(0, 1)], 1: [send(1, 0)]}, stuck, end="stall", world=2)
    assert (f.kind, f.waiting_ranks, f.absent_ranks) == ("hang", (0, 1), ())
    assert [c["ranks"] for c in f.data["cycle"]] == [[0], [1]] and "batch_isend_irecv" in f.summary
    # rank 0 alone in world #2 while ranks 1-3 wait in metrics #1 for it: two findings, rank 0 the odd one
    traces = traces_of(ev(0, 1), ev(0, 2, done=False), *(ev(r, 1) for r in (1, 2, 3)),
                       *(ev(r, 1, group="m", done=False) for r in (1, 2, 3)))
    found = run(traces, {r: RankOutcome(rank=r, state="stuck", phase="running") for r in WORLD4}, end="stall")
    assert sorted((h.group, h.waiting_ranks) for h in found if h.kind == "hang") == [("0", (0,)), ("m", (1, 2, 3))]
