"""What the report says is what was seen (items 6 and 7): pure tests of the rules on hand-built evidence.

* a root shared by several ranks names all of them; "waiting in" only for a rank that was waiting;
* a call every peer left and finished is a certain hang, whatever the shapes in it (the wait-for graph);
* an IterableDataset pass whose ranks read the same rows is a ``duplicates`` finding from those rows, whatever
  the ranks' models made of them (the loader's batches digested as they were yielded).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib

import pytest

from distcheck.diagnose.common import whereabouts
from distcheck.diagnose import duplicates
from distcheck.diagnose.duplicates import find_duplicates
from distcheck.diagnose.rules import RunFacts, analyze
from distcheck.launch.progress import RankProgress
from distcheck.diagnose.waitfor import certain_hang
from distcheck.launch.watchdog import Decision, Limits, StallDetector
from distcheck.models import Event, RankOutcome
from distcheck.rank import row_digests

SITE = "/home/u/share.py:{}:<module>"
CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
          "by peer [127.0.0.1]:{}. This is typically caused by a remote worker crashing.")
NOT_IN_GROUP = ("ValueError: Global rank 0 is not part of group "
                "<torch.distributed.distributed_c10d.ProcessGroup object at {}>")


def ev(rank: int, seq: int, op: str, group: str, members: tuple[int, ...], line: int, error: str | None = None,
       done: bool = True) -> Event:
    return Event(rank=rank, group=group, seq=seq, op=op, reduce_op="SUM" if op == "all_reduce" else None,
                 shapes=((1,),), dtypes=("float32",), device="cpu", group_ranks=members, t_enter=1.0,
                 t_exit=1.1 if done or error else None, error=error, callsite=SITE.format(line))


# -- item 6: a broadcast_object_list given a group-local source ------------------------------------------------

def _object_src_local() -> tuple[dict, dict]:
    """Ranks 2 and 3 raise the same ValueError (object addresses differ) in their pair's broadcast_object_list;
    ranks 0 and 1 then fail in the world all_reduce with gloo's "Connection closed by peer" (ports differ)."""
    traces = {r: [ev(r, 1, "broadcast_object_list", "1" if r < 2 else "2", (0, 1) if r < 2 else (2, 3), 13,
                     error=None if r < 2 else NOT_IN_GROUP.format(hex(0x7f00 + r)))] for r in range(4)}
    for r in (0, 1):
        traces[r].append(ev(r, 1, "all_reduce", "0", (0, 1, 2, 3), 15, error=CLOSED.format(6400 + r)))
    outcomes = {r: RankOutcome(rank=r, state="crashed", phase="error", exception=NOT_IN_GROUP.format(hex(0x7f00 + r)),
                               exit_code=1, where=SITE.format(13), last_event=traces[r][-1]) for r in (2, 3)}
    outcomes |= {r: RankOutcome(rank=r, state="stuck", phase="error", exception=CLOSED.format(6400 + r), exit_code=1,
                                where=SITE.format(15), last_event=traces[r][-1]) for r in (0, 1)}
    return traces, outcomes


def test_a_root_several_ranks_share_names_all_of_them_though_their_words_differ_in_an_address():
    traces, outcomes = _object_src_local()
    [crash] = analyze(traces, outcomes, RunFacts(world_size=4, end_reason="crash"))
    assert crash.kind == "crash" and crash.odd_ranks == (2, 3)
    assert crash.data["root_ranks"] == [2, 3] and crash.data["root_rank"] == 2
    assert "rank 3 failed the same way" in crash.summary and "rank 3 raised" not in crash.summary


def test_a_peer_whose_call_raised_is_said_to_have_failed_in_it_never_to_wait_in_it():
    traces, outcomes = _object_src_local()
    [crash] = analyze(traces, outcomes, RunFacts(world_size=4, end_reason="crash"))
    assert "waiting in" not in crash.summary
    assert ("meanwhile ranks 0, 1 failed in all_reduce #1 (group 0) at /home/u/share.py:15 when a peer was gone "
            "(Connection closed by peer).") in crash.summary
    assert {d.rank: d.note for d in crash.ranks if d.role == "peer"} == {
        r: "failed in all_reduce #1 (group 0) at /home/u/share.py:15 when a peer was gone (Connection closed by peer)"
        for r in (0, 1)}


def test_a_rank_still_in_its_call_is_waiting_in_it_and_another_error_is_said_by_its_first_line():
    waiting = ev(0, 3, "barrier", "0", (0, 1), 20, done=False)
    assert whereabouts(0, RankOutcome(rank=0, state="stuck", last_event=waiting)) == \
        "waiting in barrier #3 (group 0) at /home/u/share.py:20"
    raised = ev(0, 3, "barrier", "0", (0, 1), 20, error="RuntimeError: bad buffer\n  more")
    assert whereabouts(0, RankOutcome(rank=0, state="stuck", phase="error", last_event=raised)) == \
        "failed in barrier #3 (group 0) at /home/u/share.py:20 with RuntimeError: bad buffer"


def test_different_errors_keep_one_root_and_say_the_other():
    traces = {r: [ev(r, 1, "all_reduce", "0", (0, 1, 2), 9, error=f"KeyError: 'k{r}'")] for r in (1, 2)}
    outcomes = {r: RankOutcome(rank=r, state="crashed", phase="error", exception=f"KeyError: 'k{r}'", exit_code=1,
                               last_event=traces[r][-1]) for r in (1, 2)}
    outcomes[0] = RankOutcome(rank=0, state="finished", phase="finished")
    [crash] = analyze(traces, outcomes, RunFacts(world_size=3, end_reason="crash"))
    assert crash.odd_ranks == (1,) and crash.data["root_ranks"] == [1]
    assert "; rank 2 raised KeyError: 'k2'" in crash.summary


def test_a_crash_outside_every_call_after_a_size_mismatch_it_returned_from_is_linked_to_it():
    """torch.bincount without minlength: rank 1 all-reduces 5 values against rank 0's 4, gloo lets it through, and
    rank 1 raises later in cross_entropy, outside every collective. The mismatch is the cause, said first."""
    traces = {r: [ev(r, 1, "all_reduce", "0", (0, 1), 12)._replace(shapes=((4 + r,),))] for r in (0, 1)}
    outcomes = {0: RankOutcome(rank=0, state="finished", phase="finished", last_event=traces[0][-1]),
                1: RankOutcome(rank=1, state="crashed", phase="error", exit_code=1, where=SITE.format(14),
                               exception="ValueError: Expected input batch_size (5) to match target batch_size (4).",
                               last_event=traces[1][-1])}
    findings = analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash"))
    kinds = [f.kind for f in findings]
    assert kinds.index("mismatch") < kinds.index("crash"), kinds
    [crash] = [f for f in findings if f.kind == "crash"]
    assert crash.caused_by is not None and crash.caused_by.kind == "mismatch" and crash.caused_by.seq == 1
    assert "follows from the shape mismatch in all_reduce #1 at /home/u/share.py:12" in crash.summary, crash.summary


def test_a_crash_with_no_size_mismatch_before_it_stands_alone():
    traces = {r: [ev(r, 1, "all_reduce", "0", (0, 1), 12)] for r in (0, 1)}
    outcomes = {0: RankOutcome(rank=0, state="finished", phase="finished", last_event=traces[0][-1]),
                1: RankOutcome(rank=1, state="crashed", phase="error", exit_code=1, where=SITE.format(14),
                               exception="ValueError: bad", last_event=traces[1][-1])}
    [crash] = analyze(traces, outcomes, RunFacts(world_size=2, end_reason="crash"))
    assert crash.caused_by is None


# -- item 7: a call every peer left and finished ----------------------------------------------------------------

MEMBERS = tuple(range(8))


def _left_and_finished(sig: str = "all_reduce 3,3 int64 - -", **kw) -> RankProgress:
    return RankProgress(records=2, phase="finished", settled=True, entered={"0": 1}, left=(("0", 1, sig),),
                        cpu=0.0, **kw)


def _in_call(sig: str = "all_reduce 4,4 int64 - -", cpu: float | None = 0.0, settled: bool = True) -> RankProgress:
    return RankProgress(records=1, open_collectives=1, phase="running", settled=settled, cpu=cpu,
                        waits=(("0", 1, MEMBERS, sig),), entered={"0": 1})


@pytest.mark.parametrize("sig", ["all_reduce 4,4 int64 - -", "all_reduce 3,3 int64 - -"], ids=["other", "same"])
def test_a_call_every_peer_left_and_finished_is_a_certain_hang_whatever_its_shapes(sig):
    seen = {r: _left_and_finished() for r in range(7)} | {7: _in_call(sig)}
    hang = certain_hang(seen)
    assert hang is not None and hang.waiting == (7,) and hang.ranks == MEMBERS
    assert hang.evidence == ("certain: rank 7 waits in all_reduce #1 (group 0), which every other member left: "
                             "ranks 0-6 finished")
    # confirmed like a clash (a call every member entered can look open a while on a loaded node), with no timeout
    d = StallDetector(world_size=8, limits=Limits(stall_timeout=30.0), start=0.0)
    assert d.observe(1.0, seen) is Decision.CONTINUE and d.observe(1.5, seen) is Decision.CONTINUE
    assert d.observe(1.9, seen) is Decision.DEADLOCK and d.certain.reason == "clash"


def test_ranks_still_in_the_call_its_other_members_left_wait_there_together():
    seen = {r: _left_and_finished() for r in range(6)} | {6: _in_call(), 7: _in_call()}
    hang = certain_hang(seen)
    assert hang is not None and hang.waiting == (6, 7)
    assert hang.evidence.startswith("certain: ranks 6, 7 wait in all_reduce #1 (group 0)")


@pytest.mark.parametrize("case", ["peer running", "peer left no trace", "waiter busy", "co-waiter busy",
                                  "co-waiter unsettled", "peer on the device"])
def test_a_call_that_may_yet_complete_is_left_to_the_stall_timeout(case):
    seen = {r: _left_and_finished() for r in range(7)} | {7: _in_call()}
    if case == "peer running":         # it left the call and runs on: not gone (the rule is about finished peers)
        seen[3] = RankProgress(records=2, phase="running", settled=True, entered={"0": 1},
                               left=(("0", 1, "all_reduce 3,3 int64 - -"),))
    elif case == "peer left no trace":   # an async call it never waited on: its work may still be under way
        seen[3] = RankProgress(records=2, phase="finished", settled=True, entered={"0": 1})
    elif case == "waiter busy":          # copying or reducing what its peers sent
        seen[7] = _in_call(cpu=0.9)
    elif case == "co-waiter busy":
        seen[6] = _in_call(cpu=0.9)
    elif case == "co-waiter unsettled":
        seen[6] = _in_call(settled=False)
    else:                                # NCCL: finished, its next call returned and waits on the device
        seen[3] = _left_and_finished(open_collectives=1, waits=(("0", 2, MEMBERS, "all_reduce 3,3 int64 - -"),))
    assert certain_hang(seen) is None


def test_a_p2p_transfer_its_peer_left_is_not_judged_by_this_rule():
    seen = {0: RankProgress(records=1, open_collectives=1, phase="running", settled=True, cpu=0.0,
                            waits=(("p2p:0>1", 1, (0, 1), "send 4 float32"),), entered={"p2p:0>1": 1}),
            1: RankProgress(records=2, phase="finished", settled=True, entered={"p2p:0>1": 1},
                            left=(("p2p:0>1", 1, "recv 4 float32"),), cpu=0.0)}
    assert certain_hang(seen) is None


# -- item 7: the rows an IterableDataset pass yielded -------------------------------------------------------------

def _rows(ids, level=0) -> dict:
    digests = [zlib.crc32(f"sample {i}".encode()) for i in ids]
    return {"t0": 10.0, "rows": len(ids), "level": level, "digests": [d for d in digests if not d & ((1 << level) - 1)]}


def _pass(ids, t=10.0, **kw) -> dict:
    return {"dataset": "EvalStream (loader 0, pass 0)", "iterable": True, "stage": None, "t_start": t,
            "batches": 12, "complete": True, "rows": _rows(ids), **kw}


def _compute(rank: int, world: int, t: float = 20.0) -> list[Event]:
    """A synced metric's compute() after the pass: torchmetrics' all_gather."""
    return [Event(rank=rank, group="0", seq=1, op="all_gather", shapes=((1,),), dtypes=("float32",), device="cpu",
                  group_ranks=tuple(range(world)), t_enter=t, t_exit=t + 0.01, callsite="/home/u/eval.py:47:main",
                  label="MulticlassAccuracy.compute")]


def test_ranks_that_read_the_same_stream_are_told_from_the_rows_they_read():
    results = {r: {"samples": [_pass(range(96))]} for r in range(2)}
    traces = {r: _compute(r, 2) for r in range(2)}
    [f] = duplicates.find_read_duplicates(results, 2, traces)
    assert (f.kind, f.severity, f.odd_ranks) == ("duplicates", "error", (0, 1))
    assert f.data["read"] and f.data["same_on_every_rank"] and f.data["use"] == "compared"
    assert "each of its 2 ranks read the same 96 rows, by their content" in f.summary
    assert "counts 192 rows for 96 samples" in f.summary and "split the stream by rank" in f.summary
    assert [g.summary for g in find_duplicates(results, 2, traces)] == [f.summary]


def test_disjoint_shards_of_a_stream_are_no_finding_and_a_shared_shard_names_its_ranks():
    shards = {r: {"samples": [_pass(range(r, 96, 3))]} for r in range(3)}
    traces = {r: _compute(r, 3) for r in range(3)}
    assert duplicates.find_read_duplicates(shards, 3, traces) == []
    shards[1] = {"samples": [_pass(range(0, 96, 3))]}     # rank 1 read rank 0's shard
    [f] = duplicates.find_read_duplicates(shards, 3, traces)
    assert f.severity == "error" and f.odd_ranks == (0, 1) and not f.data["same_on_every_rank"]
    assert "rank 0: 100%, rank 1: 100% were read on another rank too" in f.summary


def test_rows_read_in_a_pass_no_collective_took_are_only_a_note():
    results = {r: {"samples": [_pass(range(96))]} for r in range(2)}
    [f] = duplicates.find_read_duplicates(results, 2, {0: [], 1: []})
    assert f.severity == "info" and f.data["use"] == "unused" and "No harm:" in f.summary


def test_what_the_metric_was_fed_already_says_is_not_said_twice():
    ids = range(60)
    fed_rows = {"t0": 50.0, "rows": 60, "level": 0,
                "digests": [zlib.crc32(str((round(random.Random(i).gauss(0, 1), 6), i % 3)).encode()) for i in ids]}
    results = {}
    for r in range(2):
        sync = {"ranks": [0, 1], "seq": 4, "after": 7, "group_rank": r, "rank": r, "t0": 100.0, "t1": 100.2}
        entry = {"id": "m0", "class": "MulticlassAccuracy", "qualname": "MulticlassAccuracy", "collection": False,
                 "sync_on_compute": True, "fresh": None, "chunks": [], "updates": 8, "note": None,
                 "computes": [{"epoch": 0, "updates": 8, "callsite": "/home/u/eval.py:47:main", "value": 0.5,
                               "sync": sync}], "rows": {"0": fed_rows}}
        results[r] = {"metrics": [entry], "samples": [_pass(ids)]}
    [f] = find_duplicates(results, 2, {r: _compute(r, 2, t=100.0) for r in range(2)})
    assert f.data.get("fed") and not f.data.get("read")


def test_a_batch_is_digested_by_its_content_and_left_as_it_was():
    import torch

    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    before = (x.clone(), y.clone())
    digests, rows = row_digests.batch_digests([x, y])
    assert rows == 8 and len(digests) == 8 and len(set(digests)) == 8
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])
    assert row_digests.batch_digests([x.clone(), y.clone()])[0] == digests            # the same samples anywhere
    assert row_digests.batch_digests([x + 1, y])[0] != digests                        # other samples
    # batch_size=None: each item is one sample
    assert row_digests.batch_digests((x[2], y[2]), collated=False)[0].tolist() == [digests[2]]
    assert row_digests.batch_digests({"x": x, "names": [f"s{i}" for i in range(8)]})[1] == 8
    big = torch.randn(4, 3, 32, 32)                        # a wide row is read at ROW_ELEMENTS spaced elements
    assert len(row_digests.batch_digests([big])[0]) == 4 and row_digests.ROW_ELEMENTS < big[0].numel()
    assert row_digests.batch_digests([object()]) == (row_digests.batch_digests([])[0], 0)


RECORDER = """
import json, sys, torch
from pathlib import Path
from torch.utils.data import DataLoader, IterableDataset
from distcheck.rank import guard
from distcheck.rank.samples import SampleRecorder
path = Path(sys.argv[1]) / "samples.jsonl"
SampleRecorder(path).install()

class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            yield torch.randn(6, generator=g), torch.randint(0, 3, (), generator=g)

class Broken(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2)
        raise LookupError("the user's stream broke")

seen = []
for x, y in DataLoader(Stream(), batch_size=8):
    seen.append(x.sum().item())
for item in DataLoader(Stream(), batch_size=None):
    pass
try:
    for _ in DataLoader(Broken(), batch_size=1):
        pass
except LookupError as exc:
    user_error = f"{type(exc).__name__}: {exc}"
lines = [json.loads(l) for l in path.read_text().splitlines()]
clean = guard.failures()
SampleRecorder._read = lambda *a: 1 / 0          # a failing recorder: the loop sees the same batches
again = [x.sum().item() for x, y in DataLoader(Stream(), batch_size=8)]
print(json.dumps({"lines": lines, "seen": seen, "again": again, "failures": clean, "user_error": user_error,
                  "broken": guard.failures()}))
"""


def test_the_recorder_digests_what_an_iterable_pass_yields(tmp_path):
    out = subprocess.run([sys.executable, "-c", RECORDER, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["seen"]) == 3 and got["failures"] == {}
    assert got["user_error"] == "LookupError: the user's stream broke"     # the loader's own error, unchanged
    assert got["again"] == got["seen"] and got["broken"]["samples"]["count"] == 3   # counted, never raised
    batched, single, broken = got["lines"]
    assert broken["rows"]["rows"] == 1 and not broken["complete"]
    assert batched["iterable"] and batched["complete"] and batched["batches"] == 3
    assert batched["rows"]["rows"] == 20 and len(batched["rows"]["digests"]) == 20
    assert single["rows"]["rows"] == 20 and single["rows"]["digests"] == batched["rows"]["digests"]
