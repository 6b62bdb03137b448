"""The trace file's writer and readers (distcheck.files.trace): the memory-mapped slots, growth, threads,
fork, a record caught half-written, a restarted rank. In-process, with the real tracer where it writes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from distcheck.files.trace import (SLOT, call_key, enter_slot, exit_slot, fingerprint_record, group_record,
                                   text_slots)
from distcheck.files.trace_reader import parse_trace
from distcheck.files.trace_tail import TraceTail
from distcheck.files.trace_writer import TraceWriter
from distcheck.rank.tracer import Tracer

WORLD = object()
# Every test through both hot paths (tests/conftest.py): in C the tracer's writer keeps its position in a cursor.
pytestmark = pytest.mark.usefixtures("hot_path")


def fake_tracer(path) -> Tracer:
    return Tracer(path, 0, group_resolver=lambda pg: ("w", (0, 1)), default_group=lambda: WORLD)


def all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def test_the_file_grows_past_its_first_mapping_and_close_trims_it(tmp_path, hot_path):
    path = tmp_path / "rank0.trace"
    tracer = fake_tracer(path)
    assert (tracer.writer.cursor is not None) == (hot_path == "c")   # in C, records go in through the cursor
    traced = tracer.wrap("all_reduce", all_reduce)
    calls = 3 * TraceWriter.INITIAL_BYTES // (2 * SLOT)     # three times what the first mapping holds
    t = torch.ones(2)
    for _ in range(calls):
        traced(t)
    assert path.stat().st_size > TraceWriter.INITIAL_BYTES
    tracer.close()
    data = path.read_bytes()
    trace = parse_trace(0, data)
    assert [e.seq for e in trace.events] == list(range(1, calls + 1)) and all(e.completed for e in trace.events)
    assert len(data) % SLOT == 0 and data[-SLOT:] != bytes(SLOT)          # no unwritten end left
    traced(t)                                                             # after close: dropped, no error
    assert path.read_bytes() == data


def test_threads_never_interleave_inside_a_record(tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = fake_tracer(path)
    traced = tracer.wrap("all_reduce", all_reduce)
    per_thread = 3000

    def work(n: int) -> None:
        t = torch.ones(n)
        for _ in range(per_thread):
            traced(t)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    trace = parse_trace(0, path.read_bytes())
    assert trace.corrupt_records == 0 and not trace.truncated
    assert len(trace.events) == 4 * per_thread and all(e.completed for e in trace.events)
    assert {e.shapes for e in trace.events} == {((1,),), ((2,),), ((3,),), ((4,),)}


def test_a_forked_child_writes_nothing_into_its_parents_trace(tmp_path):
    path = tmp_path / "rank0.trace"
    tracer = fake_tracer(path)
    traced = tracer.wrap("all_reduce", all_reduce)
    traced(torch.ones(1))
    pid = os.fork()
    if pid == 0:   # a DataLoader worker, say: not the rank
        try:
            traced(torch.ones(7))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    traced(torch.ones(1))
    events = parse_trace(0, path.read_bytes()).events
    assert [(e.seq, e.shapes) for e in events] == [(1, ((1,),)), (2, ((1,),))]


def test_a_restarted_rank_goes_on_after_the_records_already_there(tmp_path):
    path = tmp_path / "rank0.trace"
    first = fake_tracer(path)
    first.wrap("all_reduce", all_reduce)(torch.ones(1))    # killed without close: the preallocated end stays
    first.writer.append(enter_slot(0, 0, 2, 30)[:SLOT // 2])   # ... and in the middle of a record
    again = TraceWriter(path)
    again.write(text_slots(group_record(5, "later", (0, 1)) + fingerprint_record(9, "barrier", None, "-", "-", "-",
                                                                                  None, False, "-"))
                + enter_slot(5, 9, 1, 10) + exit_slot(call_key(5, 1), 20))
    again.close()
    events = parse_trace(0, path.read_bytes()).events
    assert [(e.group, e.op) for e in events] == [("w", "all_reduce"), ("later", "barrier")]


def test_a_file_that_is_not_a_trace_is_started_afresh(tmp_path):
    path = tmp_path / "rank0.trace"
    path.write_bytes(b"G\t0\t0,1\nE\t0\t1\t0\t5\n")           # an older distcheck's text trace
    tracer = fake_tracer(path)
    tracer.wrap("all_reduce", all_reduce)(torch.ones(1))
    tracer.close()
    trace = parse_trace(0, path.read_bytes())
    assert [e.op for e in trace.events] == ["all_reduce"] and trace.corrupt_records == 0


def test_the_watchdog_leaves_a_half_written_record_for_its_next_read(tmp_path):
    path = tmp_path / "rank0.trace"
    writer = TraceWriter(path)
    writer.write(text_slots(group_record(0, "0", (0, 1)) + fingerprint_record(0, "barrier", None, "-", "-", "-",
                                                                              None, False, "-")))
    writer.close()
    record = enter_slot(0, 0, 1, 1_700_000_000_000_000_000)
    with open(path, "ab") as f:                        # the record's first half only, as a reader may catch it
        f.write(record[:SLOT // 2] + bytes(SLOT // 2))
    tail = TraceTail(path).read()
    assert tail.records == 0 and tail.newest_open is None
    with open(path, "r+b") as f:
        f.seek(-SLOT // 2, os.SEEK_END)
        f.write(record[SLOT // 2:])
    call = tail.read().newest_open
    assert tail.records == 1 and (call.op, call.group, call.seq, call.t_enter) == ("barrier", "0", 1, 1.7e9)


def test_without_shared_mappings_each_record_is_appended(tmp_path, monkeypatch):
    from distcheck.files import trace_writer

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")   # what mmap says on a file system that cannot map files

    monkeypatch.setattr(trace_writer.mmap, "mmap", refuse)
    path = tmp_path / "rank0.trace"
    tracer = fake_tracer(path)
    assert tracer.writer.mm is None
    traced = tracer.wrap("all_reduce", all_reduce)
    for _ in range(3):
        traced(torch.ones(2))
    assert [(e.seq, e.completed) for e in parse_trace(0, path.read_bytes()).events] == [(1, True), (2, True), (3, True)]
    tracer.close()
    traced(torch.ones(2))                  # closed: dropped, the call itself goes on
    assert len(parse_trace(0, path.read_bytes()).events) == 3


def test_a_torn_sync_record_is_ignored_and_the_last_whole_one_kept(tmp_path):
    from distcheck.files.trace import SLOT, SYNC_OFFSET, read_sync, sync_slot
    from distcheck.files.trace_tail import TraceTail

    writer = TraceWriter(tmp_path / "rank0.trace")
    writer.sync(2_000_000_000, True, stack_digest=7)
    tail = TraceTail(tmp_path / "rank0.trace").read()
    assert tail.sync == (2.0, True, 7)
    torn = bytearray(sync_slot(3_000_000_000, 9, True))
    torn[8:12] = b"\xff\xff\xff\xff"                       # caught half-overwritten
    assert read_sync(bytes(torn)) is None
    writer.mm[SYNC_OFFSET:SYNC_OFFSET + SLOT] = bytes(torn)
    assert tail.read().sync == (2.0, True, 7)
    writer.close()


def test_the_watchdog_reads_what_a_live_rank_wrote_past_its_first_small_read(tmp_path):
    """A poll reads a little of the file first (its preallocated end is zeros: reading a whole megabyte of
    them at every poll cost 0.3 ms a rank), then more while what it read was all records. A rank that wrote
    5,000 calls since the last poll is read whole in one poll, and an idle poll after it finds nothing."""
    path = tmp_path / "rank0.trace"
    tracer = fake_tracer(path)
    traced = tracer.wrap("all_reduce", all_reduce)
    t = torch.ones(2)
    tail = TraceTail(path).read()
    for _ in range(5000):                     # 2 slots a call: 320 KB, 20 times the first read
        traced(t)
    assert 5000 * 2 * SLOT >= 16 * TraceTail.FIRST_READ_BYTES
    assert path.stat().st_size > 5000 * 2 * SLOT   # the unwritten, preallocated end is still there
    assert tail.read().records == 10000 and tail.entered == {"w": 5000} and tail.newest_open is None
    assert tail.read().records == 10000
    traced_barrier = tracer.wrap("barrier", lambda group=None, async_op=False, device_ids=None: tail.read())
    traced_barrier()                          # inside the call, the poll sees the rank waiting in it
    assert tail.newest_open.op == "barrier" and tail.newest_open.seq == 5001
    tracer.close()
