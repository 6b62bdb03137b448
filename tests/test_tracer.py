"""The tracer, call-site resolution and the trace file format, in-process.

A one-rank gloo process group (FileStore) stands in for a job: every
collective completes at once, so these tests check *what* is recorded, not
timing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.trace_reader import parse_trace
from distcheck.rank.tracer import Tracer
from distcheck.launch.progress import RankMonitor

THIS = os.path.abspath(__file__)
pytestmark = pytest.mark.usefixtures("hot_path")   # every test through both hot paths (tests/conftest.py)


def line_of(marker: str) -> int:
    for i, text in enumerate(Path(THIS).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <{marker}>"):
            return i
    raise LookupError(marker)


@pytest.fixture
def traced(process_group, tmp_path):
    """An installed tracer; yields a function returning the parsed events so far."""
    path = tmp_path / "rank0.trace"
    tracer = Tracer(path, 0)
    tracer.install()
    try:
        yield lambda: parse_trace(0, path.read_bytes()).events
    finally:
        tracer.uninstall()
        tracer.close()


def test_fingerprint_fields_and_sequence(traced):
    t = torch.ones(3, 2)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(torch.ones(5, dtype=torch.int64))
    dist.broadcast(t, src=0)
    dist.barrier()
    ev = traced()
    assert [(e.seq, e.op, e.reduce_op) for e in ev] == [
        (1, "all_reduce", "SUM"), (2, "all_reduce", "MAX"), (3, "all_reduce", "SUM"),
        (4, "broadcast", None), (5, "barrier", None)]
    assert ev[0].shapes == ((3, 2),) and ev[0].dtypes == ("float32",) and ev[0].device == "cpu"
    assert ev[2].shapes == ((5,),) and ev[2].dtypes == ("int64",)
    assert ev[3].root == 0 and ev[4].shapes == () and ev[4].device is None
    assert all(e.group_ranks == (0,) and e.completed and not e.async_op for e in ev)
    assert all(e.callsite.startswith(f"{THIS}:") and e.callsite.endswith(":test_fingerprint_fields_and_sequence")
               for e in ev)
    assert len({e.callsite for e in ev}) == 5   # one line each


def test_same_line_in_a_loop_is_one_site_with_fresh_times(traced, tmp_path):
    t = torch.ones(1)
    for _ in range(50):
        dist.all_reduce(t)
    ev = traced()
    assert [e.seq for e in ev] == list(range(1, 51))
    assert len({e.callsite for e in ev}) == 1
    assert all(e.t_enter <= e.t_exit for e in ev)
    assert _text_records(tmp_path / "rank0.trace").count("\nF\t") == 1   # the fingerprint is written once


def slow_calls(hot_path: str, c_path: int, total: int) -> int:
    """How many calls take the tracer's slow path: in C, the first of each kind; the Python path takes it for all."""
    return c_path if hot_path == "c" else total


def test_a_repeated_call_takes_the_fast_path(process_group, tmp_path, hot_path):
    # The fast path must build the very key the slow path stores: a key that drifts apart makes every
    # call slow (+2 µs each) with no other symptom.
    tracer = Tracer(tmp_path / "rank0.trace", 0)
    tracer.install()
    try:
        t = torch.ones(1)
        for _ in range(20):
            dist.all_reduce(t)
            dist.barrier()
    finally:
        tracer.uninstall()
        tracer.close()
    assert tracer.count == 40 and tracer.slow_calls == slow_calls(hot_path, 2, 40)


def test_async_and_keyword_arguments(traced):
    work = dist.all_reduce(tensor=torch.ones(2), op=dist.ReduceOp.MIN, async_op=True)
    work.wait()
    (e,) = traced()
    assert e.async_op and e.reduce_op == "MIN" and e.shapes == ((2,),)


def test_torchmetrics_compute_label_and_callsite(traced):
    from torchmetrics.classification import BinaryAUROC

    metric = BinaryAUROC(thresholds=20)
    metric.update(torch.rand(16), torch.randint(0, 2, (16,)))
    metric.compute()  # <compute>
    ev = traced()
    assert [e.op for e in ev][:3] == ["barrier", "all_gather", "all_gather"]
    for e in ev:
        assert e.label == "BinaryAUROC.compute"
        assert e.callsite == f"{THIS}:{line_of('compute')}:test_torchmetrics_compute_label_and_callsite"
        assert "torchmetrics" in e.library_callsite


def test_torchmetrics_forward_label(traced):
    from torchmetrics.classification import BinaryAccuracy

    metric = BinaryAccuracy(dist_sync_on_step=True)
    metric(torch.rand(8), torch.randint(0, 2, (8,)))  # <forward>
    ev = traced()
    assert ev and {e.label for e in ev} == {"BinaryAccuracy.forward"}
    assert {e.callsite for e in ev} == {f"{THIS}:{line_of('forward')}:test_torchmetrics_forward_label"}


def test_label_is_the_outermost_frame_of_the_innermost_module(traced):
    class Inner(torch.nn.Module):
        def sync(self):
            return self._reduce()

        def _reduce(self):
            dist.all_reduce(torch.ones(1))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self):
            self.inner.sync()

    Outer()()
    (e,) = traced()
    assert e.label == "Inner.sync"


def test_nested_collectives_are_traced_once(traced):
    out = [None]
    dist.all_gather_object(out, {"a": 1})
    ev = traced()
    assert [e.op for e in ev] == ["all_gather_object"]
    assert out == [{"a": 1}]


def test_a_failing_call_records_its_error(traced):
    with pytest.raises(Exception):
        dist.all_reduce(torch.ones(1), group="not a group")
    dist.all_reduce(torch.ones(1))
    ev = traced()
    assert ev[-1].op == "all_reduce" and ev[-1].error is None
    failed = [e for e in ev if e.error]
    assert all(e.t_exit is not None for e in failed)



def test_the_sidecar_learns_each_number_and_the_group_is_busy_while_the_call_runs(process_group, tmp_path, hot_path):
    # rank.native takes the numbers Python calls wrote (``take_written``) and leaves the busy group's alone; a number
    # it does not learn would be recorded a second time, as a C++-issued collective.
    tracer = Tracer(tmp_path / "rank0.trace", 0)
    real = dist.all_reduce
    busy = []

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        busy.append(tracer.busy_group)
        return real(tensor, op=op, group=group, async_op=async_op)

    traced = tracer.wrap("all_reduce", spy, signature_of=real)
    t = torch.ones(1)
    try:
        for _ in range(5):
            traced(t)
    finally:
        tracer.close()
    assert busy[0] is not None and busy == busy[:1] * 5 and tracer.busy_group is None
    assert tracer.take_written(busy[0]) == [1, 2, 3, 4, 5] and tracer.take_written(busy[0]) == []
    assert tracer.count == 5 and tracer.slow_calls == slow_calls(hot_path, 1, 5)



def test_calls_after_a_monitored_barrier_that_took_fewer_numbers_are_all_recorded(process_group, tmp_path):
    # gloo's monitored_barrier on one rank takes fewer of the group's numbers than it is counted for, so the calls
    # after it are keyed with a negative skew: each one must still be recorded, and numbered as its peers number it.
    from distcheck.rank import guard

    guard.reset()
    path = tmp_path / "rank0.trace"
    tracer = Tracer(path, 0)
    tracer.install()
    t = torch.ones(1)
    try:
        for _ in range(3):
            for _ in range(2):
                dist.all_reduce(t)   # one site: the remembered call, across the skew's change
            dist.monitored_barrier()
        dist.all_reduce(t)
    finally:
        tracer.uninstall()
        tracer.close()
    ev = parse_trace(0, path.read_bytes()).events
    assert [e.op for e in ev] == ["all_reduce", "all_reduce", "monitored_barrier"] * 3 + ["all_reduce"]
    assert [e.seq for e in ev] == list(range(1, 11))
    assert guard.failures() == {}


# -- the hot path without a process group -------------------------------------------------


def _fake_tracer(path: Path) -> Tracer:
    world = object()
    return Tracer(path, 0, group_resolver=lambda pg: ("w" if pg is world else "sub", (0, 1)),
                  default_group=lambda: world)


def _stand_in_all_reduce(tensor, op=None, group=None, async_op=False):
    """all_reduce's signature, doing nothing: what ``_fake_tracer``'s wrappers stand around."""
    return None


def test_a_group_without_a_counter_leaves_no_numbers_for_the_sidecar(tmp_path, hot_path):
    # Its numbers are the tracer's own (nothing C++-issued to tell apart), so none are kept for a sidecar that
    # never reads such a group: they would pile up for the life of the rank.
    tracer = _fake_tracer(tmp_path / "rank0.trace")
    call = tracer.wrap("all_reduce", _stand_in_all_reduce)
    try:
        for _ in range(5):
            call(torch.ones(1))
    finally:
        tracer.close()
    assert tracer.count == 5 and tracer.slow_calls == slow_calls(hot_path, 1, 5) and tracer.busy_group is None
    assert tracer.take_written("w") == []
    assert [e.seq for e in parse_trace(0, (tmp_path / "rank0.trace").read_bytes()).events] == [1, 2, 3, 4, 5]


def test_enter_record_is_on_disk_before_the_call_and_exit_after(tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    seen = {}

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen["during"] = parse_trace(0, path.read_bytes()).events

    traced = tracer.wrap("all_reduce", all_reduce)
    traced(torch.ones(2))
    (during,) = seen["during"]
    assert during.op == "all_reduce" and during.t_exit is None and during.group == "w"
    (after,) = parse_trace(0, path.read_bytes()).events
    assert after.t_exit is not None and after.group_ranks == (0, 1)


def test_fast_path_notices_every_fingerprint_change(tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    sub = object()

    traced = tracer.wrap("all_reduce", _stand_in_all_reduce)
    calls = [
        ((torch.ones(2),), {}),
        ((torch.ones(2),), {}),
        ((torch.ones(3),), {}),                                   # shape
        ((torch.ones(3, dtype=torch.float64),), {}),              # dtype
        ((torch.ones(3, dtype=torch.float64), dist.ReduceOp.MAX), {}),   # reduce op
        ((torch.ones(3),), {"group": sub}),                       # group
        ((torch.ones(3),), {"async_op": True}),                   # async
    ]
    for args, kwargs in calls:
        traced(*args, **kwargs)
    ev = parse_trace(0, path.read_bytes()).events
    assert [(e.group, e.seq) for e in ev] == [("w", 1), ("w", 2), ("w", 3), ("w", 4), ("w", 5), ("sub", 1), ("w", 6)]
    assert [e.shapes for e in ev[:3]] == [((2,),), ((2,),), ((3,),)]
    assert ev[3].dtypes == ("float64",) and ev[4].reduce_op == "MAX" and ev[0].reduce_op == "SUM"
    assert ev[6].async_op and not ev[5].async_op


def test_keywords_named_by_strings_built_at_run_time_are_read(tmp_path):
    # A call's keyword names are most often the interned names of its source; ``**kwargs`` built at run time
    # passes names that are equal but not the same object, and they must be read all the same.
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    sub = object()

    traced = tracer.wrap("all_reduce", _stand_in_all_reduce)
    built = {"".join(("gro", "up")): sub, "".join(("async", "_op")): True}
    assert all(name is not sys.intern(name) for name in built)
    for _ in range(3):
        traced(torch.ones(2), **built)
    ev = parse_trace(0, path.read_bytes()).events
    assert [(e.group, e.seq, e.async_op) for e in ev] == [("sub", 1, True), ("sub", 2, True), ("sub", 3, True)]


def test_the_wrapper_adds_at_most_one_frame_and_it_is_distchecks_own(tmp_path, hot_path):
    # The C hot path adds no frame. The Python wrapper's frame, in a traceback through it and to the call-site walk,
    # must read as distcheck's (left out of what the user is shown), and it must be the only one distcheck adds.
    import traceback

    from distcheck.files.stacks import SKIP, classify_file, torch_dir
    from distcheck.report.frames import is_own_frame

    tracer = _fake_tracer(tmp_path / "rank0.trace")

    def all_reduce(tensor, op=None, group=None, async_op=False):
        raise ValueError("the user's own")

    traced = tracer.wrap("all_reduce", all_reduce)
    for _ in range(2):   # the second call takes the fast path
        with pytest.raises(ValueError, match="the user's own") as info:
            traced(torch.ones(2))
    frames = traceback.extract_tb(info.tb)[1:]   # after the test's own frame
    if hot_path == "c":
        assert [f.name for f in frames] == ["all_reduce"]   # the user's collective, called from the test
        assert tracer.slow_calls == 1 and tracer.count == 2
        return
    assert [f.name for f in frames] == ["traced", "all_reduce"]   # the wrapper, then the user's collective
    assert is_own_frame(frames[0].filename) and classify_file(frames[0].filename, torch_dir()) == SKIP
    assert tracer.slow_calls == 2 and tracer.count == 2


def test_a_traced_collective_stands_in_for_the_function_it_wraps(traced):
    # Code that inspects, binds, pickles or weakly refers to dist.all_reduce finds what it found without distcheck.
    import inspect
    import pickle
    import weakref

    import torch.distributed.distributed_c10d as c10d

    wrapped = dist.all_reduce
    original = wrapped.__distcheck_original__
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert (wrapped.__name__, wrapped.__qualname__, wrapped.__module__, wrapped.__doc__) == (
        original.__name__, original.__qualname__, original.__module__, original.__doc__)
    assert inspect.signature(wrapped) == inspect.signature(original) and "all_reduce" in repr(wrapped)
    assert pickle.loads(pickle.dumps(wrapped)) is c10d.all_reduce is wrapped
    assert weakref.ref(wrapped)() is wrapped

    class Holder:
        reduce = dist.all_reduce

    with pytest.raises((TypeError, ValueError, AttributeError, RuntimeError)):
        Holder().reduce(torch.ones(1))    # bound as a function is: the instance comes first, as without distcheck
    assert Holder.reduce is wrapped
    t = torch.ones(2)
    assert Holder.reduce(t) is None and len(traced()) == 1


def test_fast_path_tells_devices_apart_at_one_site(tmp_path, hot_path):
    # The fast key reads a CPU tensor's device as True (no torch.device made); any other device is in it as itself.
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    traced = tracer.wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: None)
    for device in ("cpu", "meta", "cpu", "meta"):
        traced(torch.ones(2, device=device))
    ev = parse_trace(0, path.read_bytes()).events
    assert [e.device for e in ev] == ["cpu", "meta", "cpu", "meta"] and tracer.slow_calls == slow_calls(hot_path, 2, 4)


def test_exception_inside_the_collective_is_recorded_and_raised(tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError):
        tracer.wrap("barrier", barrier)()
    (e,) = parse_trace(0, path.read_bytes()).events
    assert e.error == "RuntimeError: Connection closed by peer" and e.t_exit is not None


def test_a_tracer_failure_never_breaks_the_call(tmp_path):
    tracer = _fake_tracer(tmp_path / "rank0.trace")
    traced = tracer.wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: "result")
    assert traced("not a tensor") == "result"


# -- the file format ----------------------------------------------------------------------


def _sample_file(tmp_path: Path) -> bytes:
    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    traced = tracer.wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: None)
    for _ in range(3):
        traced(torch.ones(4))
    tracer.close()    # trims the preallocated end
    return path.read_bytes()


def _text_records(path: Path) -> str:
    """Every text record of a trace file (definitions), one line each."""
    from distcheck.files.trace import SLOT, TAG_C, TAG_T, used_bytes

    data = path.read_bytes()
    text = b""
    for i in range(0, used_bytes(data), SLOT):
        w0 = int.from_bytes(data[i:i + 8], "little")
        if w0 & 0xFF in (TAG_T, TAG_C):
            text += data[i + 8:i + 24]
    return "\n" + text.replace(b"\0", b"").decode()


@pytest.mark.parametrize("cut", [1, 8, 17, 31])
def test_parser_tolerates_a_record_cut_anywhere(tmp_path, cut):
    data = _sample_file(tmp_path)
    whole = parse_trace(0, data)
    assert not whole.truncated and [e.seq for e in whole.events] == [1, 2, 3] and whole.corrupt_records == 0
    trace = parse_trace(0, data[:len(data) - cut])     # killed in the middle of the last (exit) record
    assert trace.truncated and trace.corrupt_records == 0
    assert [(e.seq, e.completed) for e in trace.events] == [(1, True), (2, True), (3, False)]


def test_parser_ignores_a_record_half_copied_and_the_preallocated_end(tmp_path):
    from distcheck.files.trace import SLOT

    data = _sample_file(tmp_path)
    half = data[:-SLOT] + data[-SLOT:-SLOT // 2] + bytes(SLOT // 2)   # the last record's second half not yet there
    trace = parse_trace(0, half + bytes(64 * SLOT))
    assert trace.truncated and [(e.seq, e.completed) for e in trace.events] == [(1, True), (2, True), (3, False)]
    trace = parse_trace(0, data + bytes(64 * SLOT))
    assert not trace.truncated and len(trace.events) == 3


def test_parser_counts_records_it_cannot_resolve_and_keeps_the_rest(tmp_path):
    from distcheck.files.trace import enter_slot, slot, text_slots

    data = _sample_file(tmp_path)
    bad = (data + enter_slot(0, 77, 9, 1)          # an unknown fingerprint
           + enter_slot(55, 0, 9, 1)                  # an unknown group
           + slot(9, 1, 2)                            # an unknown tag
           + text_slots(b"Q\tnot a record\n"))       # an unknown text record
    trace = parse_trace(0, bad)
    assert [e.seq for e in trace.events] == [1, 2, 3]
    assert trace.corrupt_records == 4 and not trace.truncated


def test_a_file_that_is_not_a_trace_is_one_corrupt_record():
    old = b"G\t0\t0,1\nE\t0\t1\t0\t1700000000250000\nX\t0\t1\t1700000000500000\t-\n"   # the text format
    for data in (old, b"\x00\xffgarbage" * 40):
        trace = parse_trace(0, data)
        assert trace.events == [] and trace.corrupt_records == 1
    assert parse_trace(0, b"").corrupt_records == 0


def test_watchdog_reads_open_collectives_incrementally(tmp_path):
    files = LaunchFiles(tmp_path)
    files.make()
    tracer = _fake_tracer(files.trace(0))
    monitor = RankMonitor(files, 1)
    state = {}

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        state["progress"] = monitor.poll()[0]
        state["open"] = dict(monitor.tails[0].open)

    tracer.wrap("barrier", barrier)()
    assert len(state["open"]) == 1
    (call,) = state["open"].values()
    assert (call.op, call.seq, call.group) == ("barrier", 1, "w") and call.t_enter > 0
    assert state["progress"].current == "barrier #1 [group w]" and state["progress"].open_collectives == 1
    tail = monitor.tails[0].read()
    assert tail.records == 2 and not tail.open


def test_time_resolution_is_microseconds(tmp_path):
    (e, *_) = parse_trace(0, _sample_file(tmp_path)).events
    assert abs(e.t_enter - __import__("time").time()) < 60
    assert sys.float_info.epsilon * e.t_enter < 1e-6


def test_segments_parse_on_their_own(tmp_path):
    from distcheck.files.trace_reader import split_segments

    path = tmp_path / "rank0.trace"
    tracer = _fake_tracer(path)
    traced = tracer.wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: None)

    def call():   # one site: the C hot path remembers its last call, and must forget it with the segment
        traced(torch.ones(2))

    tracer.begin_segment("first")
    call()
    call()
    tracer.begin_segment("second")
    call()            # the fast path must not reuse the first segment's ids
    segments = split_segments(path.read_bytes())
    first, second = (parse_trace(0, segments[name]) for name in ("first", "second"))
    assert [(e.seq, e.shapes) for e in first.events] == [(1, ((2,),)), (2, ((2,),))]
    assert [(e.seq, e.shapes, e.group_ranks) for e in second.events] == [(1, ((2,),), (0, 1))]
    assert first.corrupt_records == second.corrupt_records == 0


def test_reduce_ops_made_per_call_are_not_kept(tmp_path):
    from distcheck.rank.tracer import MAX_FAST_OPS

    tracer = _fake_tracer(tmp_path / "rank0.trace")
    traced = tracer.wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: None)
    t = torch.ones(2)
    for _ in range(3 * MAX_FAST_OPS):
        traced(t, op=dist.ReduceOp(dist.ReduceOp.MAX))   # a new ReduceOp object each call
    assert len(tracer.hot_path.op_ids) <= MAX_FAST_OPS
    events = parse_trace(0, (tmp_path / "rank0.trace").read_bytes()).events
    assert len(events) == 3 * MAX_FAST_OPS and {e.reduce_op for e in events} == {"MAX"}
