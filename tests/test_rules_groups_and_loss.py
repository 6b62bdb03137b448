"""The group, lost-record and duplicate rules on hand-built traces: disjoint subgroups made with
use_local_synchronization, calls some ranks never made (a partial new_group, a barrier entered
alone that timed out) told apart from records distcheck lost, and padding that reaches no
compared result. No processes."""

from __future__ import annotations

from distcheck.diagnose.rules import behaved_as_expected, observed_kinds
from distcheck.diagnose.duplicates import find_duplicates
from distcheck.models import RankOutcome
from distcheck.rank.ops import NEW_GROUP_KEY, NOT_A_MEMBER, local_group_key, new_group_sequence
from test_rules import WORLD4, SITE, ev, finished, run, traces_of

NG = dict(reduce_op=None, shapes=(), dtypes=())


def new_group(rank: int, seq: int, members: tuple[int, ...], *, group: str = NEW_GROUP_KEY,
              in_group: tuple[int, ...] = WORLD4, line: int = 7):
    return ev(rank, seq, "new_group", group=group, members=in_group, line=line, **NG)._replace(members=members)


# -- numbering: which ranks a new_group call is compared among ------------------------------------


def test_a_plain_new_group_is_numbered_in_the_job_wide_sequence():
    assert new_group_sequence(([0, 1], False), 2, WORLD4) == (NEW_GROUP_KEY, WORLD4)
    assert new_group_sequence(None, 0, WORLD4) == (NEW_GROUP_KEY, WORLD4)


def test_a_local_new_group_is_numbered_among_the_ranks_it_names_and_a_non_member_alone():
    assert new_group_sequence(([1, 0], True), 0, WORLD4) == (local_group_key((0, 1)), (0, 1))
    assert new_group_sequence(([0, 1], True), 3, WORLD4) == (NOT_A_MEMBER, (3,))
    assert new_group_sequence((None, True), 2, WORLD4) == (local_group_key(WORLD4), WORLD4)
    long = tuple(range(40))
    key = local_group_key(long)
    assert key.startswith("new_group@0..39#") and key == local_group_key(long)


def test_disjoint_local_new_groups_are_not_a_mismatch():
    # test_c10d_object_collectives' shape: ranks 0, 1 create [0, 1] while ranks 2, 3 create [2, 3]
    events = []
    for r in WORLD4:
        pair = (0, 1) if r < 2 else (2, 3)
        events.append(new_group(r, 1, pair, group=local_group_key(pair), in_group=pair))
        events.append(ev(r, 1, group=local_group_key(pair), members=pair))
        events.append(new_group(r, 1, tuple(x for x in WORLD4 if x not in pair), group=NOT_A_MEMBER, in_group=(r,)))
    assert run(traces_of(*events)) == []


def test_plain_new_groups_created_in_a_different_order_stay_a_members_mismatch():
    events = [new_group(r, s, m) for r in WORLD4
              for s, m in enumerate([(0, 1), WORLD4] if r != 3 else [WORLD4, (0, 1)], start=1)]
    found = run(traces_of(*events))
    assert [(f.kind, f.fields) for f in found if f.severity == "error"][0] == ("mismatch", ("members",))


# -- loss claims need evidence -------------------------------------------------------------------


def test_a_plain_new_group_some_ranks_never_called_is_named_with_its_ranks_and_line_not_a_loss():
    events = [new_group(r, 1, (0, 1), line=33) for r in (0, 1)] + [ev(r, 1) for r in WORLD4]
    [f] = run(traces_of(*events))
    assert (f.kind, f.severity, f.op, f.seq) == ("count", "error", "new_group", 1)
    assert f.data == {"created_by": [0, 1], "never_called": [2, 3]} and f.odd_ranks == (2, 3)
    assert "created by ranks 0, 1 only (at " + SITE.format(33).rsplit(":", 1)[0] in f.summary
    assert "please report" not in f.summary and "use_local_synchronization=True" in f.summary


def test_a_barrier_entered_alone_that_timed_out_is_said_as_what_happened_and_the_run_passes():
    alone = ev(0, 3, "barrier", members=(0, 1), reduce_op=None, shapes=(), dtypes=(), line=51, t=10.0,
               error="RuntimeError: [gloo] Timed out waiting 1000ms for recv operation")._replace(t_exit=11.0)
    events = [ev(r, s, members=(0, 1)) for r in (0, 1) for s in (1, 2)] + [alone]
    found = run(traces_of(*events), finished(0, 1), world=2)
    [f] = found
    assert (f.kind, f.severity, f.op, f.seq, f.odd_ranks) == ("count", "info", "barrier", 3, (0,))
    assert "entered by rank 0 alone" in f.summary and "rank 1 never called it" in f.summary
    assert "after 1.0 s" in f.summary and "Timed out" in f.summary and "lost" not in f.summary
    assert behaved_as_expected(("pass",), observed_kinds(found))


def test_a_gap_in_a_ranks_own_numbering_is_a_loss():
    events = [ev(r, s) for r in WORLD4 for s in (1, 2, 3) if (r, s) != (2, 2)]
    [f] = run(traces_of(*events))
    assert (f.kind, f.severity) == ("coverage", "warning")
    assert f.data["missing"] == {"2": [2]} and f.data["evidence"] == {"2": "its own numbering went past it"}
    assert "please report" in f.summary


def test_a_last_call_a_peer_returned_from_proves_the_rank_made_it():
    events = [ev(r, s) for r in WORLD4 for s in (1, 2)] + [ev(r, 3) for r in (0, 1, 2)]   # all_reduce #3
    [f] = run(traces_of(*events))
    assert f.kind == "coverage" and f.data["missing"] == {"3": [3]}
    assert "rank 0 returned from all_reduce #3" in f.data["evidence"]["3"]


def test_the_flight_recorder_counting_a_call_proves_it_was_made():
    sent = ev(0, 2, "broadcast", root=0)   # a root can return before its peers enter
    events = [ev(r, 1, members=(0, 1)) for r in (0, 1)] + [sent._replace(group_ranks=(0, 1))]
    outcomes = {0: RankOutcome(rank=0, state="finished", phase="finished"),
                1: RankOutcome(rank=1, state="finished", phase="finished",
                               flight_recorder={"0": {"last_enqueued_collective": 2}})}
    [f] = run(traces_of(*events), outcomes, world=2)
    assert f.kind == "coverage" and f.data["evidence"] == {"1": "its Flight Recorder counted it"}


def test_a_root_that_returned_alone_without_evidence_is_the_jobs_count_difference():
    sent = ev(0, 2, "broadcast", root=0, members=(0, 1))
    events = [ev(r, 1, members=(0, 1)) for r in (0, 1)] + [sent]
    [f] = run(traces_of(*events), finished(0, 1), world=2)
    assert (f.kind, f.severity, f.tie) == ("count", "error", True)   # 2 calls against 1: no majority
    assert "broadcast #2" in f.summary


def test_a_rank_whose_tracer_failed_as_often_as_it_lacks_calls_lost_their_records():
    """Rule 3 (evidence, the rank's own counters): a rank whose tracer caught errors of its own let those calls run
    unrecorded (rule 0). A root's broadcast its peer's record lacks is then distcheck's loss, a coverage warning,
    not the job's count difference; with fewer failures than calls missing, nothing says so."""
    sent = ev(0, 2, "broadcast", root=0, members=(0, 1))
    events = [ev(r, 1, members=(0, 1)) for r in (0, 1)] + [sent]

    def peer_failed(times: int) -> dict:
        return {0: RankOutcome(rank=0, state="finished", phase="finished"),
                1: RankOutcome(rank=1, state="finished", phase="finished",
                               hook_failures={"tracer": {"count": times, "error": "PlantedFault: planted"}})}

    found = run(traces_of(*events), peer_failed(3), world=2)
    [f] = [f for f in found if f.kind != "coverage" or "missing" in f.data]
    assert (f.kind, f.severity) == ("coverage", "warning")
    assert f.data["evidence"] == {"1": "its tracer failed 3 time(s) (calls it could not record)"}
    too_few = [f for f in run(traces_of(*[sent, *[ev(0, s, members=(0, 1)) for s in (1, 3)]]), peer_failed(1),
                              world=2) if f.kind == "count"]
    assert too_few and too_few[0].severity == "error"   # rank 1 lacks 3 calls, its tracer failed once


# -- duplicates: an error only where a compared result takes them --------------------------------


def _pass(rank: int, ids: list[int], size: int, t: float, sampler: str, **extra):
    return {"dataset": "ds (loader 0, pass 0)", "dataset_size": size, "ids": ids, "complete": True,
            "t_start": t, "sampler": sampler, **extra}


DIST = "torch.utils.data.distributed.DistributedSampler"
ACCEL = "accelerate.data_loader.BatchSamplerShard"


def test_padding_that_a_collective_takes_is_an_error_naming_the_sampler():
    results = {0: {"samples": [_pass(0, [0, 2, 4], 5, 1.0, DIST)]}, 1: {"samples": [_pass(1, [1, 3, 0], 5, 1.0, DIST)]}}
    traces = traces_of(*(ev(r, 1, "all_gather", members=(0, 1), t=2.0) for r in (0, 1)))
    [f] = find_duplicates(results, 2, traces)
    assert (f.severity, f.data["use"]) == ("error", "compared")
    assert f.data["cause"].startswith("DistributedSampler padded 5 samples to 6")


def test_accelerates_padding_is_named_as_accelerates_and_gather_for_metrics_removes_it():
    results = {0: {"samples": [_pass(0, [0, 2, 4], 5, 1.0, ACCEL)]}, 1: {"samples": [_pass(1, [1, 3, 0], 5, 1.0, ACCEL)]}}
    gathered = [ev(r, 1, "all_gather", members=(0, 1), t=2.0)._replace(
        library_callsite="/site-packages/accelerate/accelerator.py:2900:gather_for_metrics") for r in (0, 1)]
    [f] = find_duplicates(results, 2, traces_of(*gathered))
    assert (f.severity, f.data["use"]) == ("info", "removed")
    assert "accelerate's BatchSamplerShard padded" in f.summary and "DistributedSampler" not in f.summary
    plain = [e._replace(library_callsite="/site-packages/accelerate/utils/operations.py:400:gather") for e in gathered]
    assert find_duplicates(results, 2, traces_of(*plain))[0].severity == "error"   # accelerator.gather keeps them


def test_padding_in_a_training_pass_is_info():
    results = {0: {"samples": [_pass(0, [0, 2, 4], 5, 1.0, ACCEL)]}, 1: {"samples": [_pass(1, [1, 3, 0], 5, 1.0, ACCEL)]}}
    ddp = [ev(r, 1, members=(0, 1), t=1.5)._replace(native=True) for r in (0, 1)]   # DDP's gradient all_reduce
    [f] = find_duplicates(results, 2, traces_of(*ddp))
    assert (f.severity, f.data["use"]) == ("info", "training") and "training pass" in f.summary


def test_every_rank_looping_over_all_data_with_no_collective_is_no_unsharded_evaluation():
    whole = list(range(8))
    results = {r: {"samples": [_pass(r, whole, 8, 1.0, "torch.utils.data.sampler.SequentialSampler"),
                               {**_pass(r, [r], 8, 5.0, DIST), "dataset": "other"}]} for r in (0, 1)}
    later = traces_of(*(ev(r, 1, members=(0, 1), t=6.0) for r in (0, 1)))   # after the next pass began
    by_name = {f.data["dataset"]: f for f in find_duplicates(results, 2, later)}
    f = by_name["ds (loader 0, pass 0)"]
    assert (f.severity, f.data["use"]) == ("info", "unused") and "no collective consumed" in f.summary


def test_a_scenarios_own_record_keeps_its_error():
    results = {r: {"samples": [{"dataset": "eval set", "dataset_size": 8, "ids": list(range(8))}]} for r in (0, 1)}
    [f] = find_duplicates(results, 2, {})
    assert f.severity == "error" and f.data["use"] is None


# -- what the tracer records of a new_group (one rank, a real gloo group) ---------------------------


def test_the_tracer_numbers_local_new_groups_among_their_ranks(process_group, tmp_path):
    import torch.distributed as dist

    from distcheck.files.trace_reader import parse_trace
    from distcheck.rank.tracer import Tracer

    path = tmp_path / "rank0.trace"
    tracer = Tracer(path, 0)
    tracer.install()
    try:
        dist.new_group([0])
        dist.new_group([0], use_local_synchronization=True)
        dist.new_group([0], use_local_synchronization=True)
        dist.new_group([0])
    finally:
        tracer.uninstall()
        tracer.close()
    events = parse_trace(0, path.read_bytes()).events
    assert [(e.group, e.seq, e.members) for e in events] == [
        (NEW_GROUP_KEY, 1, (0,)), (local_group_key((0,)), 1, (0,)), (local_group_key((0,)), 2, (0,)),
        (NEW_GROUP_KEY, 2, (0,))]
