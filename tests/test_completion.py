"""A call is done when its backend says so (NCCL's semantics), pure and in-process: the trace's D records read back
and followed live, the completion sources (the Flight Recorder in NCCL's dump format, a Python backend's completion
hook), the wait-for graph and the stall detector on calls that returned but wait on the device, and the hang's words."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from distcheck.diagnose.hang import on_the_device
from distcheck.files.trace import (RecordBatch, call_key, done_slot, enter_slot, exit_slot, fingerprint_record,
                                   group_record, text_slots, header_slots, slot, TAG_X)
from distcheck.files.trace_reader import parse_trace
from distcheck.files.trace_tail import TraceTail
from distcheck.launch.progress import RankProgress
from distcheck.diagnose.waitfor import certain_hang
from distcheck.launch.watchdog import Decision, Limits, StallDetector
from distcheck.models import Event, Phase, RankOutcome, RankState
from distcheck.rank.completion import Completion, done_through, python_completion_hook

NATIVE_GID = 1 << 23


def _trace(*records: bytes, device: bool = True) -> bytes:
    """A trace: group 0 ("0", ranks 0-1; device-completed where ``device``), the sidecar's id for the same group,
    and an all_reduce fingerprint; then ``records``."""
    defs = RecordBatch()
    defs.define(group_record(0, "0", (0, 1), device))
    defs.define(group_record(NATIVE_GID, "0", (0, 1), device))
    defs.define(b"S\t0\ttrain.py:41:main\t-\t-\n")
    defs.define(fingerprint_record(0, "all_reduce", "SUM", "1", "float32", "cpu", None, False, "0"))
    return header_slots() + defs.data() + b"".join(records)


def _e(seq: int, t: float) -> bytes:
    return enter_slot(0, 0, seq, int(t * 1e9))


def _x(seq: int, t: float) -> bytes:
    return exit_slot(call_key(0, seq), int(t * 1e9))


def _d(seq: int, t: float, gid: int = NATIVE_GID) -> bytes:
    return done_slot(gid, seq, int(t * 1e9))


# -- the record read back --------------------------------------------------------------------------------------


def test_on_a_device_group_a_call_is_done_when_a_d_record_covers_it_not_when_it_returns():
    events = parse_trace(0, _trace(_e(1, 1.0), _x(1, 1.1), _e(2, 2.0), _x(2, 2.1), _d(1, 1.5))).events
    first, second = events
    assert first.completed and first.t_exit == 1.5 and first.t_returned == pytest.approx(1.1)
    assert not second.completed and second.enqueued and second.t_returned == pytest.approx(2.1)


def test_one_d_record_covers_every_call_up_to_its_number():
    events = parse_trace(0, _trace(*(r for s in (1, 2, 3) for r in (_e(s, s), _x(s, s + 0.1))), _d(3, 9.0))).events
    assert [e.t_exit for e in events] == [9.0, 9.0, 9.0]


def test_on_any_other_group_a_call_is_done_when_it_returns():
    [e] = parse_trace(0, _trace(_e(1, 1.0), _x(1, 1.1), device=False)).events
    assert e.completed and e.t_exit == pytest.approx(1.1) and e.t_returned is None and not e.enqueued


def test_a_call_that_raised_is_over_at_its_exit_record():
    error = text_slots(b"R\t1\tRuntimeError: boom\n")
    [e] = parse_trace(0, _trace(_e(1, 1.0), error, slot(TAG_X | 1 << 8, call_key(0, 1), int(1.2e9)))).events
    assert e.error == "RuntimeError: boom" and e.t_exit == pytest.approx(1.2)


# -- the record followed live ----------------------------------------------------------------------------------


def _tail(tmp_path, data: bytes) -> TraceTail:
    path = tmp_path / "rank0.trace"
    path.write_bytes(data)
    return TraceTail(path).read()


def test_live_a_call_that_returned_stays_open_until_its_work_completed(tmp_path):
    tail = _tail(tmp_path, _trace(_e(1, 1.0), _x(1, 1.1)))
    [call] = tail.open.values()
    assert call.seq == 1 and call.returned
    path = tail.path
    path.write_bytes(path.read_bytes() + _d(1, 1.5))   # named by the sidecar's own id for the group
    assert not tail.read().open and tail.left_calls[-1][:2] == ("0", 1)


def test_live_a_wait_on_a_handle_does_not_close_a_device_call(tmp_path):
    from distcheck.files.trace import wait_slots

    tail = _tail(tmp_path, _trace(_e(1, 1.0), _x(1, 1.1), wait_slots([call_key(0, 1)], int(1.2e9), False),
                                  wait_slots([call_key(0, 1)], int(1.3e9), True)))
    assert [c.seq for c in tail.open.values()] == [1]


def test_live_on_gloo_a_call_is_left_when_it_returns(tmp_path):
    tail = _tail(tmp_path, _trace(_e(1, 1.0), _x(1, 1.1), device=False))
    assert not tail.open


# -- the completion sources -----------------------------------------------------------------------------------


def _entry(group: str, seq: int, state: str = "scheduled", *, p2p: bool = False, name: str = "nccl:all_reduce",
           completed_ns: int | None = None, retired: bool = False) -> dict:
    """A Flight Recorder entry as NCCL's dump has it (``_dump_nccl_trace``, version 2.10)."""
    return {"record_id": seq, "pg_id": 0, "process_group": (group, "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": 1, "input_sizes": [[4]],
            "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": completed_ns, "retired": retired,
            "timeout_ms": 600000, "is_p2p": p2p}


def test_the_flight_recorder_says_how_far_a_group_completed_in_order():
    entries = [_entry("0", 1, "completed"), _entry("0", 2, "completed"), _entry("0", 3, "started"),
               _entry("0", 4, "completed"), _entry("1", 7, "scheduled")]
    assert done_through(entries, {}) == {"0": 2, "1": 6}   # group 1's ring starts at 7: what came before is done


def test_a_coalesced_groups_per_op_entries_complete_with_its_group_entry():
    entries = [_entry("0", 1, "scheduled"), _entry("0", 1, "scheduled"),   # per-op: never completed themselves
               _entry("0", 1, "completed", name="nccl:coalesced"), _entry("0", 2, "scheduled")]
    assert done_through(entries, {}) == {"0": 1}


def test_a_timed_out_entry_is_not_done_and_p2p_entries_are_not_read():
    entries = [_entry("0", 1, "completed"), _entry("0", 2, "scheduled", retired=True),
               _entry("0", 3, "completed", p2p=True)]
    assert done_through(entries, {}) == {"0": 1}
    assert done_through([_entry("0", 5, "scheduled", completed_ns=10)], {"0": 4}) == {"0": 5}


def test_the_flight_recorder_is_read_only_while_a_group_has_calls_not_known_done():
    dumps = []
    clock = [0.0]

    def dump(backend):
        dumps.append(backend)
        return {"entries": [_entry("0", 1, "completed")]}

    completion = Completion(fr_dump=dump, clock=lambda: clock[0])
    completion._sources["0"], completion._names["0"] = "flight-recorder:nccl", "0"
    assert completion.done_through(pending=lambda key: False) == {} and dumps == []
    assert completion.done_through(pending=lambda key: True) == {"0": 1} and dumps == ["nccl"]
    completion.done_through(pending=lambda key: True)   # again at once: not read again
    clock[0] += 1.0
    completion.done_through(pending=lambda key: True)
    assert dumps == ["nccl", "nccl"]


class HookedGroup(dist.ProcessGroup):
    """A process group written in Python that offers a completion hook, as NCCL's process group does."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.hooks = []

    def _register_on_completion_hook(self, hook) -> None:
        self.hooks.append(hook)


class Info:
    def __init__(self, seq: int, op_type: str = "all_reduce") -> None:
        self.seq, self.op_type = seq, op_type


def test_a_python_backends_completion_hook_is_the_source_and_p2p_completions_are_left_out():
    pg = HookedGroup()
    completion = Completion()
    assert completion.attach(pg, "7") and completion.device("7") and len(pg.hooks) == 1
    assert completion.attach(pg, "7") and len(pg.hooks) == 1   # idempotent
    pg.hooks[0](Info(2))
    pg.hooks[0](Info(9, "send"))
    assert completion.done_through() == {"7": 2}


def test_a_group_without_a_completion_source_is_done_at_return():
    assert python_completion_hook(dist.ProcessGroup(0, 1)) is None   # torch's own: NCCL's alone, in C++
    assert not Completion().attach(dist.ProcessGroup(0, 1), "0")


def test_a_completion_hook_that_fails_is_counted_never_raised_into_the_backend():
    from distcheck.rank import guard

    guard.reset()
    pg = HookedGroup()
    completion = Completion()
    completion.attach(pg, "7")
    pg.hooks[0](object())   # no seq: our own failure
    assert guard.failures()["completion"]["count"] == 1
    guard.reset()


# -- the live judgement on calls that wait on the device ------------------------------------------------------


def _progress(phase=Phase.RUNNING, waits=(), entered=None, records=1) -> RankProgress:
    return RankProgress(records=records, open_collectives=len(waits), phase=phase, waits=tuple(waits),
                        entered=entered or {}, settled=True)


CALL = ("0", 2, (0, 1), "all_reduce 1 float32 - -")


def test_a_call_that_waits_on_the_device_beside_a_finished_peer_is_a_certain_hang():
    ranks = {0: _progress(waits=[CALL], entered={"0": 2}), 1: _progress(Phase.FINISHED, entered={"0": 1})}
    hang = certain_hang(ranks)
    assert hang is not None and hang.waiting == (0,) and hang.reason == "finished"


def test_a_finished_rank_whose_last_call_never_completed_still_waits_in_it():
    ranks = {0: _progress(Phase.FINISHED, waits=[CALL], entered={"0": 2}),
             1: _progress(Phase.FINISHED, entered={"0": 1})}
    hang = certain_hang(ranks)
    assert hang is not None and hang.waiting == (0,)
    detector = StallDetector(2, Limits(stall_timeout=5), start=0.0)
    assert detector.observe(0.1, ranks) != Decision.RELEASE   # no pass while a call waits on the device


def test_every_rank_finished_with_nothing_waiting_is_released():
    ranks = {r: _progress(Phase.FINISHED, entered={"0": 2}) for r in (0, 1)}
    assert StallDetector(2, Limits(stall_timeout=5), start=0.0).observe(0.1, ranks) == Decision.RELEASE


def test_the_hang_says_where_the_host_went_while_the_call_waits_on_the_device():
    e = Event(rank=0, group="0", seq=2, op="all_reduce", t_enter=1.0, t_exit=None, t_returned=1.1,
              callsite="train.py:41:main")
    stuck = RankOutcome(rank=0, state=RankState.STUCK, where="train.py:42:main")
    said = on_the_device({0: e}, {0: stuck})
    assert said == " (it returned, but its work never completed; the host is blocked at train.py:42)"
    finished = RankOutcome(rank=0, state=RankState.FINISHED)
    assert "finished: its script ended" in on_the_device({0: e}, {0: finished})
    assert on_the_device({0: e._replace(t_returned=None)}, {0: stuck}) == ""   # gloo: it was inside the call
