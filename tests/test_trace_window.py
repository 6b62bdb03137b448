"""A long trace's window (files.trace_window): what of a rank's trace crosses to node 0 on a multi-node run,
and how node 0 compares ranks on it. The traces are written by the real tracer."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed import ReduceOp

from distcheck.diagnose.common import RunFacts
from distcheck.diagnose.rules import analyze
from distcheck.diagnose.windows import find_window_divergence
from distcheck.files.trace_reader import parse_trace, read_trace_bytes, read_trace_dir
from distcheck.files.trace_window import BLOCK, KEEP_CALLS, window
from distcheck.models import EndReason
from distcheck.rank.tracer import Tracer


def _trace(path: Path, rank: int, calls: int, world: int = 2, max_at: int | None = None, own_calls: int = 0) -> bytes:
    """A rank's trace after ``calls`` all_reduces (the one numbered ``max_at`` with MAX, not SUM), then
    ``own_calls`` on a group of its own."""
    world_group, own = object(), object()   # what the tracer takes for an initialized default group, and a subgroup
    tracer = Tracer(path, rank, group_resolver=lambda pg: ("1", (rank,)) if pg is own else ("0", tuple(range(world))),
                    default_group=lambda: world_group)
    all_reduce = tracer.wrap("all_reduce", lambda tensor, op=ReduceOp.SUM, group=None, async_op=False: None)
    t = torch.ones(4)
    for seq in range(1, calls + 1):
        all_reduce(t, op=ReduceOp.MAX if seq == max_at else ReduceOp.SUM)
    for _ in range(own_calls):
        all_reduce(t, group=own)
    tracer.close()
    return read_trace_bytes(path)


def test_a_short_trace_crosses_whole_and_a_long_one_as_its_last_calls(tmp_path):
    short = _trace(tmp_path / "short.trace", 0, 50)
    assert window(short, node=1, held_at="/n1/rank0.trace") == short
    whole = _trace(tmp_path / "long.trace", 0, 3000)
    cut = window(whole, node=1, held_at="/n1/launch/traces/rank0.trace")
    assert len(cut) < len(whole) / 10
    trace = parse_trace(0, cut)
    assert trace.corrupt_records == 0 and not trace.truncated
    assert [e.seq for e in trace.events] == list(range(3000 - KEEP_CALLS + 1, 3001))
    assert all(e.t_exit is not None and e.op == "all_reduce" for e in trace.events)
    [(group, elided)] = trace.elided.items()
    assert group == "0" and elided.first_kept == 3000 - KEEP_CALLS + 1 and elided.count == 3000 - KEEP_CALLS
    assert sorted(elided.digests) == list(range((3000 - KEEP_CALLS) // BLOCK))   # the complete blocks cut
    assert elided.held_at == (1, "/n1/launch/traces/rank0.trace")


def test_node_0_compares_every_rank_on_the_calls_all_kept_and_the_rest_by_digest(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    # rank 0: node 0's own, whole; ranks 1 and 2: windows of another node's, rank 2's ending with 30 calls
    # on a group of its own, so that its window of group 0 starts 30 calls later
    _trace(traces / "rank0.trace", 0, 3000, world=3)
    for rank, own in ((1, 0), (2, 30)):
        whole = _trace(tmp_path / f"whole{rank}.trace", rank, 3000, world=3, own_calls=own)
        (traces / f"rank{rank}.trace").write_bytes(window(whole, node=1, held_at=f"/n1/rank{rank}.trace"))
    got = read_trace_dir(traces)
    first = 3000 - KEEP_CALLS + 30 + 1        # the highest window start of group 0: rank 2's
    assert {r: t.events[0].seq for r, t in got.items() if t.events[0].group == "0"} == {0: first, 1: first, 2: first}
    assert {r: len(t.events) for r, t in got.items()} == {0: 3000 - first + 1, 1: 3000 - first + 1, 2: KEEP_CALLS}
    assert all(t.elided["0"].first_kept == first for t in got.values())
    assert "1" not in got[2].elided                # its own group's calls all crossed
    assert find_window_divergence({r: t.elided for r, t in got.items()}) == []
    # every rank judged on the calls all of them kept: nothing lost, nothing divergent (the ranks' traces were
    # written one after the other, so their times may make one a straggler: that is not this test's subject)
    facts = RunFacts(world_size=3, elided={r: t.elided for r, t in got.items()})
    findings = analyze({r: t.events for r, t in got.items()}, {}, facts)
    assert [f.kind for f in findings if f.severity != "info" and f.kind != "straggler"] == [], findings
    [note] = [f for f in findings if f.kind == "coverage"]
    assert f"#{first} of group 0" in note.summary and "stayed on nodes 0, 1," in note.summary


def test_an_other_reduce_op_before_the_window_is_found_by_digest_and_said_where_the_records_are(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    _trace(traces / "rank0.trace", 0, 3000)
    whole = _trace(tmp_path / "whole1.trace", 1, 3000, max_at=700)     # call #700: MAX on rank 1, SUM on rank 0
    (traces / "rank1.trace").write_bytes(window(whole, node=3, held_at="/n3/launch/traces/rank1.trace"))
    got = read_trace_dir(traces)
    [finding] = find_window_divergence({r: t.elided for r, t in got.items()})
    assert finding.kind == "mismatch" and finding.severity == "error" and finding.group == "0"
    block = (700 - 1) // BLOCK
    assert f"#{block * BLOCK + 1}" in finding.summary and f"#{(block + 1) * BLOCK}" in finding.summary
    assert "/n3/launch/traces/rank1.trace" in finding.summary and "node 3" in finding.summary
    assert finding.tie and sorted(finding.odd_ranks + tuple(finding.data["sides"][0])) == [0, 1]
    facts = RunFacts(world_size=2, end_reason=EndReason.COMPLETED, elided={r: t.elided for r, t in got.items()})
    findings = analyze({r: t.events for r, t in got.items()}, {}, facts)
    assert [f.kind for f in findings if f.severity == "error"] == ["mismatch"]
    [note] = [f for f in findings if f.kind == "coverage"]
    assert note.severity == "info" and "stayed on nodes 0, 3," in note.summary


def test_the_digests_of_a_window_cut_from_columns_are_digest_of_its_calls():
    """A node digests a trace's calls from its columns (a block of one op without a tuple per call); node 0
    digests the ranks it has whole with ``digest_of``. Both must give the same digest for the same calls:
    numbered in order or not, one op or mixed, cut anywhere."""
    import random

    from distcheck.files.trace_window import BLOCK, _digests_before, digest_of

    sites = {1: ("g", "all_reduce", "sum"), 2: ("g", "broadcast", "none"), 3: ("g", "all_reduce", "max"),
             4: ("g", "all_reduce", "sum")}
    rng = random.Random(3)
    for _ in range(500):
        start = rng.choice([1, 2, BLOCK, BLOCK + 1, 2 * BLOCK + 1, 1000])
        seqs = list(range(start, start + rng.randint(0, 6 * BLOCK)))
        if seqs and rng.random() < 0.2:   # a number out of order, or twice
            seqs[rng.randrange(len(seqs))] = rng.randint(1, 9 * BLOCK)
        choices = rng.choice([[1], [1, 4], [1, 2, 3, 4]])
        w0s = [rng.choice(choices) for _ in seqs]
        first = rng.randint(1, 9 * BLOCK)
        expected = digest_of((s, *sites[w][1:]) for s, w in zip(seqs, w0s) if s < first)
        assert _digests_before(first, seqs, w0s, sites) == expected


def test_the_traces_judged_are_drawn_without_a_second_read_and_a_changed_folder_is_read_again(tmp_path):
    # node 0 reads a job's traces to judge them (keep=True), then draws the timeline from the same folder
    # (reuse=True): at 4,096 ranks the second read was two thirds of writing the report
    traces = tmp_path / "traces"
    traces.mkdir()
    for rank in range(3):
        _trace(traces / f"rank{rank}.trace", rank, 40, world=3)
    judged = read_trace_dir(traces, keep=True)
    first = judged[1].events[0]
    judged[1].events = judged[1].events[:5]            # the judgment cuts a trace at the decision
    drawn = read_trace_dir(traces, reuse=True)
    assert drawn[1].events[0] is first and len(drawn[1].events) == 40   # not read again, and not cut
    assert read_trace_dir(traces, reuse=True)[1].events[0] is not first  # held for one reuse only
    read_trace_dir(traces, keep=True)
    _trace(traces / "rank2.trace", 2, 41, world=3)     # a rank's trace grew since (the tracer appends): read again
    assert [len(t.events) for t in read_trace_dir(traces, reuse=True).values()] == [40, 40, 81]
