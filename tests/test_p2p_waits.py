"""P2P waits (issue 30): a rank blocked in ``work.wait()`` on the handle of an ``isend``, ``irecv`` or
``batch_isend_irecv`` op (a pipelining schedule's P2P) is in that call. The trace's W records as the
watchdog and the analysis read them, the tracer writing them around a real ``Work.wait``, and the wait-for
graph's rules on synthetic observations (pure, injected clock). The real pipelining jobs are in
test_ecosystem_e2e.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distcheck.files.trace import (call_key, enter_slot, exit_slot, fingerprint_record, group_record, site_record,
                                   text_slots, wait_slots)
from distcheck.files.trace_reader import parse_trace
from distcheck.files.trace_tail import TraceTail
from distcheck.files.trace_writer import TraceWriter
from distcheck.launch.progress import RankProgress
from distcheck.launch.watchdog import Decision, Limits, StallDetector
from distcheck.rank.ops import OPS
from distcheck.rank.tracer import Tracer

T0 = 1_700_000_000_000_000_000   # ns


# -- the trace: W records -----------------------------------------------------------------------------

def _p2p_trace(path, *, waits_out: bool) -> None:
    """isend #1 and #2 on pair 0>1 (async: E and X at once), then a wait on #1's handle (in, maybe out)."""
    writer = TraceWriter(path)
    writer.write(text_slots(group_record(0, "p2p:0>1", (0, 1)) + site_record("0", "job.py:9:<module>", None, None)
                            + fingerprint_record(0, "isend", None, "4x16", "float32", "cpu", 1, True, "0")))
    for seq in (1, 2):
        writer.write(enter_slot(0, 0, seq, T0 + seq) + exit_slot(call_key(0, seq), T0 + seq + 1))
    writer.write(wait_slots([call_key(0, 1)], T0 + 100, out=False))
    if waits_out:
        writer.write(wait_slots([call_key(0, 1)], T0 + 200, out=True))
    writer.close()


def test_a_wait_on_an_async_calls_handle_opens_that_call_for_the_watchdog_until_it_returns(tmp_path):
    path = tmp_path / "rank0.trace"
    _p2p_trace(path, waits_out=False)
    tail = TraceTail(path).read()
    [call] = tail.open.values()
    assert (call.op, call.group, call.seq, call.members) == ("isend", "p2p:0>1", 1, (0, 1))
    assert call.t_enter == (T0 + 100) / 1e9   # when the wait began
    assert tail.entered == {"p2p:0>1": 2} and tail.records == 5 and tail.last_record_ns == T0 + 100
    with open(path, "ab") as f:
        f.write(wait_slots([call_key(0, 1)], T0 + 200, out=True))
    assert tail.read().open == {} and tail.records == 6


def test_the_analysis_reads_a_handle_still_waited_on_as_the_blocking_call_the_rank_is_in(tmp_path):
    path = tmp_path / "rank0.trace"
    _p2p_trace(path, waits_out=False)
    trace = parse_trace(0, path.read_bytes())
    assert trace.corrupt_records == 0
    assert [(e.seq, e.async_op, e.t_exit is None) for e in trace.events] == [(2, True, False), (1, False, True)]
    assert trace.events[-1].t_enter == (T0 + 100) / 1e9 and trace.events[-1].callsite == "job.py:9:<module>"
    returned = tmp_path / "rank1.trace"
    _p2p_trace(returned, waits_out=True)   # the wait returned: an async call like any other
    assert [(e.seq, e.async_op, e.t_exit is not None) for e in parse_trace(0, returned.read_bytes()).events] == [
        (1, True, True), (2, True, True)]


def test_torchs_own_wait_is_in_place_while_no_handle_is_held(process_group, tmp_path):
    # Every blocking collective calls its handle's wait() from Python: the wrapper is there only while an async
    # call's handle is held, and a wait on a held handle is still written (W records) after it came back.
    path = tmp_path / "rank0.trace"
    tracer = Tracer(path, 0)
    own = dist.Work.wait
    tracer.install()
    try:
        dist.all_reduce(torch.ones(2))
        assert dist.Work.wait is own   # no handle held: torch's own wait, untouched
        handle = dist.all_reduce(torch.ones(2), async_op=True)
        assert dist.Work.wait.__distcheck_original__ is own
        assert handle.wait() is True
        del handle   # the handle is gone: the next wait on another handle gives torch its wait back
        dist.all_reduce(torch.ones(2))
        assert dist.Work.wait is own
        again = dist.all_reduce(torch.ones(2), async_op=True)
        assert dist.Work.wait.__distcheck_original__ is own
        again.wait()
    finally:
        tracer.uninstall()
        tracer.close()
    assert dist.Work.wait is own
    assert TraceTail(path).read().records == 4 * 2 + 2 * 2   # 4 calls x (E, X), 2 waits x (in, out)


def test_the_tracer_writes_a_wait_on_an_async_calls_handle_and_leaves_other_handles_alone(process_group, tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = Tracer(path, 0)
    tracer.install()
    try:
        # isend's own signature and spec, issuing a real async call whose Work stands for the P2P handle
        # (a one-rank gloo group has no peer to send to)
        isend = tracer.wrap("isend", lambda tensor, dst=None, group=None, tag=0, group_dst=None:
                            dist.all_reduce(tensor, async_op=True), OPS["isend"], signature_of=dist.isend)
        handle = isend(torch.ones(4), 0)
        collective = dist.all_reduce(torch.ones(2), async_op=True)   # traced: its handle is held too
        untraced = tracer._originals["all_reduce"](torch.ones(2), async_op=True)   # a handle distcheck never saw
        assert collective.wait() is True and handle.wait() is True   # torch's own results, through the wrapper
        assert untraced.wait() is True
        assert dist.Work.wait.__distcheck_original__ is not None
    finally:
        tracer.uninstall()
        tracer.close()
    assert not hasattr(dist.Work.wait, "__distcheck_original__")   # uninstall gives torch its own wait back
    events = parse_trace(0, path.read_bytes()).events
    assert [(e.op, e.async_op, e.completed) for e in events] == [("isend", True, True), ("all_reduce", True, True)]
    tail = TraceTail(path).read()
    assert tail.open == {} and tail.records == 8   # 2 calls x (E, X), and two waits: in, out


# -- the wait-for graph -----------------------------------------------------------------------------------

def waiting(group: str, seq: int, entered: dict, op: str = "irecv") -> RankProgress:
    """Blocked in ``work.wait()`` on the handle of P2P call ``seq`` of pair ``group`` (``p2p:src>dst``)."""
    src, dst = (int(r) for r in group.removeprefix("p2p:").split(">"))
    return RankProgress(records=10, open_collectives=1, phase="running", settled=True, entered=entered,
                        waits=((group, seq, (src, dst), f"{op} 4x16 float32 - -"),))


def computing(entered: dict, evidence: str | None = "its processes used 1.0 cores") -> RankProgress:
    return RankProgress(records=10, phase="running", settled=True, entered=entered, evidence=evidence)


def detector(world: int = 3, stall: float = 20.0) -> StallDetector:
    return StallDetector(world_size=world, limits=Limits(stall_timeout=stall), start=0.0)


def observe(d: StallDetector, seen: dict, at=(1.0, 1.3, 2.0)) -> list[Decision]:
    return [d.observe(t, seen) for t in at]


# A 3-stage GPipe whose middle stage runs 4 microbatches where its neighbours run 2: stage 0 waits for the
# backward from stage 1, stage 1 for a third forward from stage 0, stage 2 in its backward send to stage 1.
MISMATCHED_MICROBATCHES = {
    0: waiting("p2p:1>0", 1, {"p2p:0>1": 2}),
    1: waiting("p2p:0>1", 3, {"p2p:0>1": 3, "p2p:1>2": 2}),
    2: waiting("p2p:2>1", 1, {"p2p:1>2": 2, "p2p:2>1": 2}, op="isend"),
}


def test_stages_waiting_on_each_others_p2p_handles_are_a_certain_cycle_without_the_stall_timeout():
    d = detector()
    assert observe(d, MISMATCHED_MICROBATCHES) == [Decision.CONTINUE, Decision.CONTINUE, Decision.DEADLOCK]
    assert d.certain.reason == "cycle" and d.certain.waiting == (0, 1)
    assert d.certain.evidence == "certain: ranks 0, 1 wait for each other (a cycle)"
    d = detector()   # from the last stage: it waits on stage 1, which is in the cycle
    assert observe(d, {**MISMATCHED_MICROBATCHES, 0: waiting("p2p:1>0", 1, {"p2p:0>1": 2})})[-1] is Decision.DEADLOCK


def test_a_p2p_wait_on_a_peer_that_is_computing_is_late_not_hung():
    seen = {0: computing({"p2p:0>1": 2}), 1: waiting("p2p:0>1", 3, {"p2p:0>1": 3, "p2p:1>2": 2}),
            2: waiting("p2p:1>2", 3, {"p2p:1>2": 3})}
    d = detector(stall=5.0)
    assert observe(d, seen, at=(1.0, 2.0, 3.0, 30.0)) == [Decision.CONTINUE] * 4   # stage 0 still makes progress
    assert d.certain is None


def test_a_p2p_wait_on_a_peer_that_already_posted_the_matching_op_is_completing():
    # stage 1 posted irecv #3 (async, not waited on yet) and waits in another call, on stage 2, which computes
    seen = {0: waiting("p2p:0>1", 3, {"p2p:0>1": 3}, op="isend"),
            1: waiting("p2p:2>1", 1, {"p2p:0>1": 3, "p2p:1>2": 2}), 2: computing({"p2p:1>2": 2})}
    assert observe(detector(), seen)[-1] is Decision.CONTINUE


def test_both_sides_of_one_transfer_waiting_in_it_is_no_clash():
    # a large tensor on its way: the sender waits in isend #3, the receiver in irecv #3, on the same pair
    seen = {0: waiting("p2p:0>1", 3, {"p2p:0>1": 3}, op="isend"), 1: waiting("p2p:0>1", 3, {"p2p:0>1": 3})}
    d = detector(world=2)
    assert observe(d, seen) == [Decision.CONTINUE] * 3 and d.certain is None


def test_a_send_to_a_rank_that_receives_from_any_source_is_not_paired_by_number():
    seen = {0: waiting("p2p:0>1", 2, {"p2p:0>1": 2}, op="isend"),
            1: RankProgress(records=5, open_collectives=1, phase="running", settled=True,
                            entered={"p2p:any>1": 2, "0": 1}, waits=(("0", 1, (0, 1), "barrier - - - -"),))}
    assert observe(detector(world=2), seen)[-1] is Decision.CONTINUE


def test_a_p2p_wait_on_a_finished_peer_is_certain():
    seen = {0: waiting("p2p:1>0", 4, {"p2p:0>1": 3}), 1: RankProgress(records=9, phase="finished", settled=True,
                                                                      entered={"p2p:1>0": 3})}
    d = detector(world=2)
    assert observe(d, seen)[-2:] == [Decision.DEADLOCK, Decision.DEADLOCK]
    assert d.certain.reason == "finished" and d.certain.waiting == (0,)


def test_p2p_waits_that_cannot_be_told_certain_end_at_the_stall_timeout():
    # every rank blocked in a P2P wait, one of them on a receive from any source: no certainty, but a stall
    seen = {0: waiting("p2p:1>0", 1, {"p2p:0>1": 2}),
            1: RankProgress(records=10, open_collectives=1, phase="running", settled=True, entered={"p2p:any>1": 1},
                            waits=(("p2p:any>1", 1, (1,), "irecv 4x16 float32 - -"),))}
    d = detector(world=2, stall=5.0)
    assert observe(d, seen, at=(0.0, 2.0, 4.9)) == [Decision.CONTINUE] * 3
    assert d.observe(5.0, seen) is Decision.STALL
