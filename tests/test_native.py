"""C++-issued collectives (rank/native.py): found through the group's counter and the Flight Recorder,
written into the trace as ordinary records. Pure tests with stand-in groups and recorder entries."""

from __future__ import annotations

import threading

from distcheck.files.trace_reader import parse_trace
from distcheck.files.trace_writer import TraceWriter
from distcheck.files.stacks import LIBRARY, torch_dir
from distcheck.rank.issuers import issuer_label, python_caller, user_line
from distcheck.rank.native import NativeCall, NativeWatcher


class Counter:
    """A process group's collective counter."""

    def __init__(self) -> None:
        self.seq = 0

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


class PythonSide:
    """What the tracer tells the watcher: its own numbers, the group a Python call is in."""

    def __init__(self, path) -> None:
        self.writer = TraceWriter(path)
        self.lock = threading.Lock()
        self.busy_group = None
        self.completion = None
        self.written: dict[str, list[int]] = {}

    def take_written(self, key: str) -> list[int]:
        return self.written.pop(key, [])

    def seq_base(self, key: str) -> int:
        return 0

    def trace_seq(self, key: str, offset: int) -> int:
        return offset

    def handles_on_device(self) -> bool:
        return False

    def completed_on_device(self) -> list[int]:
        return []


def watcher(tmp_path, calls):
    pg = Counter()
    side = PythonSide(tmp_path / "rank0.trace")
    w = NativeWatcher(side, main_thread=threading.get_ident(), groups=lambda: [("0", pg)],
                      calls=lambda: calls, detail_interval_s=0.0, recorder=calls is not None)
    return w, pg, side


def events(tmp_path):
    return parse_trace(0, (tmp_path / "rank0.trace").read_bytes()).events


def test_calls_the_tracer_wrote_are_not_repeated(tmp_path):
    w, pg, side = watcher(tmp_path, {})
    pg.seq, side.written["0"] = 3, [1, 2, 3]
    w.poll(now=1.0)
    assert not events(tmp_path)


def test_cpp_calls_between_python_calls_are_found(tmp_path):
    # DDP: init broadcasts (C++), a Python all_reduce in forward, the reducer's all_reduce (C++)
    calls = {("0", 1): NativeCall("broadcast", retired=True), ("0", 3): NativeCall("all_reduce", retired=True)}
    w, pg, side = watcher(tmp_path, calls)
    pg.seq, side.written["0"] = 3, [2]
    w.poll(now=1.0)
    assert [(e.seq, e.op) for e in events(tmp_path)] == [(1, "broadcast"), (3, "all_reduce")]


def test_a_cpp_call_in_flight_is_open_until_the_recorder_retires_it(tmp_path):
    calls = {("0", 1): NativeCall("all_reduce", ((5,),), ("float32",), t_created=0.5, retired=False)}
    w, pg, _ = watcher(tmp_path, calls)
    pg.seq = 1
    w.poll(now=1.0)
    [e] = events(tmp_path)
    assert (e.group, e.seq, e.op, e.shapes, e.dtypes, e.native) == ("0", 1, "all_reduce", ((5,),), ("float32",), True)
    assert e.t_exit is None and e.t_enter == 0.5 and not e.async_op
    calls[("0", 1)] = NativeCall("all_reduce", ((5,),), ("float32",), t_created=0.5, retired=True)
    w.poll(now=2.0)
    [e] = events(tmp_path)
    assert e.t_exit == 2.0


def test_numbers_a_python_call_is_still_using_are_left_to_it(tmp_path):
    calls = {("0", 1): NativeCall("all_gather", retired=True), ("0", 2): NativeCall("all_gather", retired=True)}
    w, pg, side = watcher(tmp_path, calls)
    side.busy_group, side.written["0"], pg.seq = "0", [1], 2   # an object collective runs two all_gathers
    w.poll(now=1.0)
    assert events(tmp_path) == []
    side.busy_group, side.written["0"] = None, [2]              # its second number, once it returned
    w.poll(now=2.0)
    assert events(tmp_path) == []


def test_cpp_calls_before_a_python_call_still_in_flight_are_found(tmp_path):
    # ranks that finished their DDP steps wait in a barrier: the reducer's calls before it still count
    calls = {("0", 1): NativeCall("all_reduce", retired=True), ("0", 2): NativeCall("all_reduce", retired=True)}
    w, pg, side = watcher(tmp_path, calls)
    side.busy_group, side.written["0"], pg.seq = "0", [3], 3
    w.poll(now=1.0)
    assert [(e.seq, e.op) for e in events(tmp_path)] == [(1, "all_reduce"), (2, "all_reduce")]


def test_without_a_recorder_the_calls_are_counted_but_never_left_open(tmp_path):
    w, pg, _ = watcher(tmp_path, None)
    pg.seq = 2
    w.poll(now=1.0)
    evs = events(tmp_path)
    assert [(e.seq, e.op, e.completed) for e in evs] == [(1, "?", True), (2, "?", True)]
    assert not w.recorder


def test_the_newest_call_waits_a_poll_for_its_recorder_entry(tmp_path):
    calls = {}
    w, pg, _ = watcher(tmp_path, calls)
    pg.seq = 1
    w.poll(now=1.0)
    assert events(tmp_path) == []
    calls[("0", 1)] = NativeCall("broadcast", ((3,),), ("int64",), retired=True)
    w.poll(now=1.1)
    assert [e.op for e in events(tmp_path)] == ["broadcast"]


def test_issuer_is_named_from_the_main_threads_stack():
    ddp_backward = [("/venv/torch/autograd/graph.py", 824, "_engine_run_backward"),
                    ("/venv/torch/_tensor.py", 625, "backward"), ("/home/u/train.py", 11, "main")]
    assert issuer_label("all_reduce", ((5,),), ddp_backward) == "DDP gradient all_reduce, bucket of 5 elements"
    ddp_init = [("/venv/torch/nn/parallel/distributed.py", 900, "_sync_module_states"),
                ("/venv/torch/nn/parallel/distributed.py", 820, "__init__"), ("/home/u/train.py", 5, "main")]
    assert issuer_label("broadcast", ((6,),), ddp_init) == "DDP init broadcast"
    funcol = [("/venv/torch/distributed/_functional_collectives.py", 200, "wait_tensor"), ("/home/u/x.py", 3, "f")]
    assert issuer_label("all_reduce", ((4,),), funcol) == "functional collective all_reduce"
    fsdp = [("/venv/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 1, "foreach_all_gather")]
    assert issuer_label("all_gather", ((36,),), fsdp) == "FSDP all_gather"
    assert issuer_label("all_reduce", ((1,),), [("/home/u/x.py", 3, "f")]) == "C++-issued all_reduce"


def test_a_call_made_from_python_past_the_tracer_is_not_called_cpp_issued_nor_placed_nowhere():
    # Lightning's strategy broadcast, its object through torch.distributed's Python API, that API's own global
    # ``broadcast`` taken past the tracer's wrapper: the stack says Python made it, and whose Python.
    torch = torch_dir().rstrip("/")
    lightning = "/venv/lib/python3.11/site-packages/lightning/pytorch/strategies/ddp.py"
    frames = [(f"{torch}/distributed/distributed_c10d.py", 2800, "broadcast"),
              (f"{torch}/distributed/c10d_logger.py", 81, "wrapper"),
              (f"{torch}/distributed/distributed_c10d.py", 3500, "broadcast_object_list"),
              (lightning, 305, "broadcast"),
              ("/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py", 1000, "fit")]
    assert python_caller(frames) == "lightning"
    assert issuer_label("broadcast", ((1,),), frames) == "lightning broadcast"
    assert user_line(frames, torch) is None and user_line(frames, torch, LIBRARY) == f"{lightning}:305:broadcast"
    users = [(f"{torch}/distributed/distributed_c10d.py", 2800, "all_reduce"), ("/home/u/train.py", 9, "main")]
    assert issuer_label("all_reduce", ((1,),), users) == "all_reduce"   # the user's own: "called from all_reduce"
    # the main thread in the user's code, not inside the API: nothing says Python made it
    assert python_caller([("/home/u/train.py", 9, "main")]) is None


# -- exact records: destroyed groups, failures, the sync record (issue 24) -----------------------------------


def test_a_group_destroyed_between_polls_is_read_one_last_time(tmp_path):
    # a script's last C++-issued calls, then destroy_process_group() before the sidecar's next poll
    calls = {("0", 1): NativeCall("all_reduce", ((5,),), ("float32",), retired=True),
             ("0", 2): NativeCall("broadcast", ((3,),), ("int64",), retired=False)}
    pg, side = Counter(), PythonSide(tmp_path / "rank0.trace")
    alive = [("0", pg)]
    w = NativeWatcher(side, main_thread=threading.get_ident(), groups=lambda: list(alive), calls=lambda: calls,
                      detail_interval_s=10.0, recorder=True)
    w.poll(now=1.0)                 # the group exists, nothing counted yet
    pg.seq = 2
    alive.clear()                   # destroyed: it is no longer among the process groups
    w.poll(now=1.1)                 # inside the rate limit, but a destroyed group cannot wait
    evs = events(tmp_path)
    assert [(e.seq, e.op, e.completed) for e in evs] == [(1, "all_reduce", True), (2, "broadcast", True)]
    assert w.pgs == {} and "0" not in w.seen


def test_a_failure_names_its_cpp_call_from_its_traceback(tmp_path):
    calls = {("0", 1): NativeCall("all_reduce", ((577,),), ("float32",), retired=False)}
    w, pg, _ = watcher(tmp_path, calls)
    pg.seq = 1
    from distcheck.files.stacks import torch_dir

    torch = torch_dir().rstrip("/")
    backward = [(f"{torch}/autograd/graph.py", 824, "_engine_run_backward"),
                (f"{torch}/_tensor.py", 625, "backward"), ("/home/u/train.py", 14, "<module>")]
    w.flush(frames=backward)
    [e] = events(tmp_path)
    assert e.label == "DDP gradient all_reduce, bucket of 577 elements" and e.callsite == "/home/u/train.py:14:<module>"
    assert e.completed   # the rank's work is over: flushed calls are closed


def test_the_sync_record_says_when_every_counted_call_was_written(tmp_path):
    from distcheck.files.trace_tail import TraceTail

    calls = {("0", 1): NativeCall("all_reduce", retired=False), ("0", 2): NativeCall("barrier", retired=False)}
    pg, side = Counter(), PythonSide(tmp_path / "rank0.trace")
    w = NativeWatcher(side, main_thread=threading.get_ident(), groups=lambda: [("0", pg)], calls=lambda: calls,
                      detail_interval_s=1.0, recorder=True)
    tail = TraceTail(tmp_path / "rank0.trace")
    assert tail.read().synced_at is None and not tail.settled   # a new file: nothing synced yet
    pg.seq = 1
    w.poll(now=5.0)
    assert tail.read().synced_at == 5.0 and tail.records == 1 and tail.settled
    pg.seq = 2
    w.poll(now=5.5)                                               # rate-limited: call 2 is not written ...
    assert tail.read().synced_at == 5.0 and tail.records == 1     # ... so the sync stays behind it
    w.poll(now=6.5)
    tail.read()
    assert tail.synced_at == 6.5 and tail.records == 2 and tail.entered == {"0": 2} and tail.settled


def test_a_counted_call_waiting_for_its_recorder_entry_holds_the_sync_back(tmp_path):
    from distcheck.files.trace_tail import TraceTail

    calls = {}
    w, pg, _ = watcher(tmp_path, calls)
    tail = TraceTail(tmp_path / "rank0.trace")
    w.poll(now=1.0)
    assert tail.read().synced_at == 1.0
    pg.seq = 1
    w.poll(now=1.1)                     # counted, not in the recorder yet: not written, and not synced past it
    assert tail.read().synced_at == 1.0 and tail.records == 0
    calls[("0", 1)] = NativeCall("all_reduce", ((577,),), ("float32",), retired=False)
    w.poll(now=1.2)
    assert tail.read().synced_at == 1.2 and tail.records == 1
