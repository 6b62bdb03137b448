"""``emulated_nccl``: a process-group backend that the host sees exactly as it sees NCCL's, on CPU, over gloo.

distcheck is built on machines without GPUs, and one GPU cannot hold two NCCL ranks. What distcheck must get right
on NCCL is what the *host* sees: a collective returns as soon as its work is enqueued, and the rank blocks later,
somewhere else. This backend reproduces that view, so the NCCL semantics are proven on CPU, in CI:

* every call returns at once, with a ``Work`` whose ``wait()`` returns at once (NCCL's only orders streams, unless
  ``TORCH_NCCL_BLOCKING_WAIT`` is set);
* its work runs later, in issue order, on the group's "stream" (a thread that runs gloo's call and waits for it);
  a send or receive on a stream of its peer's, as NCCL runs P2P calls on a stream per peer;
* ``barrier()`` blocks the host until it completes (NCCL's synchronizes the stream);
* ``synchronize()`` (this module's) blocks until every stream has drained: ``torch.cuda.synchronize()``'s part; and a
  thread that reads a tensor a pending call still writes or reads (``.item()``, ``.tolist()``, printing it, an op
  on it) first waits for that call, as a device-to-host copy waits for the stream (a ``TorchFunctionMode`` on the
  thread that made the group);
* the group's sequence number (``_get_sequence_number_for_group``) counts collectives, not P2P calls, as NCCL's
  ``seqCollective_``;
* completion is reported through ``_register_on_completion_hook(fn)``, the process group's completion hook NCCL
  offers (``fn(info)`` with ``info.seq``, ``info.op_type``, ``info.time_started``, ``info.time_finished``), in
  completion order: the one seam distcheck reads completion from on a backend registered from Python;
* a call that fails on the stream ends the process as NCCL's watchdog does (its message, then SIGABRT), and one
  that outlives the group's timeout says NCCL's "Watchdog caught collective operation timeout" first.

Use: ``import distcheck.testing.emulated_nccl as en; en.register()``, then ``init_process_group("emulated_nccl")``
(``distcheck run --backend emulated_nccl`` does both in its ranks). Only torch is imported here.
"""

from __future__ import annotations

import collections
import datetime
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

NAME = "emulated_nccl"


@dataclass(frozen=True)
class WorkInfo:
    """What a completion hook is given (the fields of NCCL's ``WorkInfo`` distcheck reads)."""

    op_type: str
    seq: int
    time_started: float
    time_finished: float


class _Call:
    """One call on the stream: what it runs, the tensors it touches, and when it is done."""

    __slots__ = ("op", "seq", "run", "tensors", "done", "error", "future", "enqueued", "work", "__weakref__")

    def __init__(self, op: str, seq: int, run: Callable[[], Any], tensors: list[torch.Tensor]) -> None:
        self.op, self.seq, self.run, self.tensors = op, seq, run, tensors
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.future: torch.futures.Future = torch.futures.Future()
        self.enqueued = time.time()
        self.work: Any = None   # gloo's, once the stream ran it


class EmulatedWork(dist._Work):
    """NCCL's ``Work`` as the host sees it: ``wait()`` returns at once; ``is_completed()`` and the future follow
    the stream."""

    def __init__(self, call: _Call, blocking: bool = False) -> None:
        super().__init__()
        self._call, self._blocking = call, blocking

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # A barrier's wait synchronizes, as NCCL's does; so does a timed wait. So does a wait from torch's own C++
        # code (DDP's parameter check reads what it gathered on the host next: on CUDA that read is a copy that
        # waits for the stream; here nothing else would make it wait). The Python API's and the user's waits
        # return at once.
        if self._blocking or timeout or _waited_from_cpp():
            self._call.done.wait(None if not timeout else timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        return self._call.done.is_set()

    def is_success(self) -> bool:
        return self._call.done.is_set() and self._call.error is None

    def get_future(self) -> torch.futures.Future:
        return self._call.future

    def result(self) -> list[torch.Tensor]:
        return list(self._call.tensors)

    def _source_rank(self) -> int:
        """A receive from any source: who sent it (known once it ran; asking waits for it, as NCCL's does)."""
        self._call.done.wait()
        return self._call.work._source_rank()

    source_rank = _source_rank


def _waited_from_cpp() -> bool:
    """The wait was called from C++ code torch runs for Python (its nearest Python frame is torch's own, but not
    ``distributed_c10d``'s collectives), or from a thread with no Python frame at all."""
    try:
        caller = sys._getframe(2).f_code.co_filename
    except ValueError:
        return True
    return "/torch/" in caller and not caller.endswith("distributed_c10d.py")


class _Stream:
    """The group's stream: its calls run in issue order on one thread; completions go to the hooks."""

    def __init__(self, group: EmulatedNCCL) -> None:
        self.group = weakref.ref(group)
        self.queue: collections.deque[_Call] = collections.deque()
        self.ready = threading.Condition()
        self.hooks: list[Callable[[WorkInfo], None]] = []
        self.timeout_s = group.timeout_s
        self.thread = threading.Thread(target=self._loop, name=f"{NAME}-stream", daemon=True)
        self.thread.start()

    def submit(self, call: _Call) -> None:
        with self.ready:
            self.queue.append(call)
            self.ready.notify()

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.queue or _LINK_DOWN.is_set():
                    self.ready.wait()
                call = self.queue[0]
            self._run(call)
            with self.ready:
                self.queue.popleft()
                self.ready.notify_all()

    def _run(self, call: _Call) -> None:
        started = time.time()
        try:
            work = call.work = call.run()
            if work is not None and not work.wait(datetime.timedelta(seconds=self.timeout_s)):
                raise TimeoutError("timed out")
        except BaseException as exc:   # NCCL's watchdog: an async error takes the process down
            call.error = exc
            _abort_like_nccl(call, exc, started, self.timeout_s)
        call.done.set()
        call.future.set_result(list(call.tensors))
        finished = time.time()
        for hook in list(self.hooks):
            try:
                hook(WorkInfo(call.op, call.seq, started, finished))
            except Exception as exc:   # NCCL aborts its communicators when a hook raises; say it and go on
                sys.stderr.write(f"[{NAME}] a completion hook raised {type(exc).__name__}: {exc}\n")

    def drain(self) -> None:
        with self.ready:
            while self.queue:
                self.ready.wait()


def _abort_like_nccl(call: _Call, exc: BaseException, started: float, timeout_s: float) -> None:
    """NCCL's watchdog's words, in the shape its process leaves them on stderr, then SIGABRT."""
    ran_ms = int((time.time() - started) * 1000)
    numel = sum(t.numel() for t in call.tensors)
    rank = dist.get_rank() if dist.is_initialized() else -1
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        why = (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={call.seq}, "
               f"OpType={call.op.upper()}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={int(timeout_s * 1000)}) "
               f"ran for {ran_ms} milliseconds before timing out.")
    else:
        why = f"[Rank {rank}] NCCL error in collective {call.op} #{call.seq}: {exc}"
    sys.stderr.write(f"[Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
                     "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n"
                     f"[Rank {rank}] To avoid data inconsistency, we are taking the entire process down.\n"
                     "terminate called after throwing an instance of 'c10::DistBackendError'\n"
                     f"  what():  [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group watchdog thread "
                     f"terminated with exception: {why}\n")
    sys.stderr.flush()
    os.abort()


class _Pending:
    """Tensors pending calls still touch, by id: a read on the host waits for their call, as a copy to the host
    waits for the stream."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._lock = threading.Lock()

    def add(self, call: _Call) -> None:
        with self._lock:
            for t in call.tensors:
                self._calls[id(t)] = (weakref.ref(t), weakref.ref(call))

    def wait_for(self, tensors: list[Any]) -> None:
        for t in tensors:
            entry = self._calls.get(id(t))
            if entry is None:
                continue
            tensor, call = entry[0](), entry[1]()
            if tensor is t and call is not None:
                call.done.wait()
            with self._lock:
                if self._calls.get(id(t)) is entry:
                    del self._calls[id(t)]


PENDING = _Pending()


class _WaitOnRead(TorchFunctionMode):
    """On the thread that made the group: an op on a tensor a pending call touches waits for that call."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if PENDING._calls:
            PENDING.wait_for(_tensors_in(args) + _tensors_in(tuple(kwargs.values())))
        return func(*args, **kwargs)


def _tensors_in(values: tuple) -> list[Any]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


_STREAMS: weakref.WeakSet = weakref.WeakSet()
_LINK_DOWN = threading.Event()


def link_down() -> None:
    """From now on no stream runs another call (a network fault): calls still enqueue and return, none completes."""
    _LINK_DOWN.set()
_MODE_THREADS: set[int] = set()


def synchronize() -> None:
    """Block until every group's stream has drained (``torch.cuda.synchronize()`` on the emulated device)."""
    for stream in list(_STREAMS):
        stream.drain()


class EmulatedNCCL(dist.ProcessGroup):
    """The process group ``init_process_group("emulated_nccl")`` makes (see the module's docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self.timeout_s = timeout.total_seconds()
        self._name, self._desc = "", ""
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.seq_collective = 0
        self.seq_p2p = 0
        self.stream = _Stream(self)
        _STREAMS.add(self.stream)
        self.p2p_streams: dict[int, _Stream] = {}   # peer -> its stream (NCCL: a communicator per peer pair)
        if threading.get_ident() not in _MODE_THREADS:   # once per thread: its reads wait for pending calls
            _MODE_THREADS.add(threading.get_ident())
            _WaitOnRead().__enter__()

    # -- what distcheck reads -------------------------------------------------------------------------------
    def getBackendName(self) -> str:   # noqa: N802 - the C++ names torch's trampoline forwards
        return NAME

    def getGroupName(self) -> str:   # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:   # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:   # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:   # noqa: N802
        self._desc = desc

    def _get_backend_name(self) -> str:
        return NAME

    def _get_sequence_number_for_group(self) -> int:
        return self.seq_collective

    def _get_backend(self, device: Any) -> Any:
        """The backend below (its ``options._timeout`` is the group's timeout, as NCCL's backend's is)."""
        return self.gloo

    def _register_on_completion_hook(self, hook: Callable[[WorkInfo], None]) -> None:
        self.stream.hooks.append(hook)
        for stream in self.p2p_streams.values():
            stream.hooks.append(hook)

    def _stream_for(self, peer: int | None) -> _Stream:
        if peer is None:
            return self.stream
        if peer not in self.p2p_streams:
            stream = self.p2p_streams[peer] = _Stream(self)
            stream.hooks.extend(self.stream.hooks)
            _STREAMS.add(stream)
        return self.p2p_streams[peer]

    # -- the calls --------------------------------------------------------------------------------------------
    def _enqueue(self, op: str, run: Callable[[], Any], tensors: list[torch.Tensor], peer: int | None = None,
                 blocking: bool = False) -> EmulatedWork:
        if peer is not None:
            self.seq_p2p += 1
            seq = self.seq_p2p
        else:
            self.seq_collective += 1
            seq = self.seq_collective
        call = _Call(op, seq, run, [t for t in tensors if isinstance(t, torch.Tensor)])
        PENDING.add(call)
        self._stream_for(peer).submit(call)
        work = EmulatedWork(call, blocking)
        if blocking:
            work.wait()
        return work

    def allreduce(self, tensors: list, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._enqueue("all_reduce", lambda: self.gloo.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any) -> EmulatedWork:
        return self._enqueue("allreduce_coalesced", lambda: self.gloo.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors: list, opts: Any) -> EmulatedWork:
        return self._enqueue("broadcast", lambda: self.gloo.broadcast(tensors, opts), tensors)

    def reduce(self, tensors: list, opts: Any) -> EmulatedWork:
        return self._enqueue("reduce", lambda: self.gloo.reduce(tensors, opts), tensors)

    def allgather(self, outputs: list, inputs: list, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._enqueue("all_gather", lambda: self.gloo.allgather(outputs, inputs, opts),
                             [t for lst in outputs for t in lst] + list(inputs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> EmulatedWork:  # noqa: A002
        return self._enqueue("_allgather_base", lambda: self.gloo._allgather_base(output, input, opts),
                             [output, input])

    _allgather_base = all_gather_single   # the name torch releases before 2.13 call

    def allgather_coalesced(self, outputs: list, inputs: list, opts: Any) -> EmulatedWork:
        return self._enqueue("allgather_coalesced", lambda: self.gloo.allgather_coalesced(outputs, inputs, opts),
                             [t for lst in outputs for t in lst] + list(inputs))

    def gather(self, outputs: list, inputs: list, opts: Any) -> EmulatedWork:
        return self._enqueue("gather", lambda: self.gloo.gather(outputs, inputs, opts),
                             [t for lst in outputs for t in lst] + list(inputs))

    def scatter(self, outputs: list, inputs: list, opts: Any) -> EmulatedWork:
        return self._enqueue("scatter", lambda: self.gloo.scatter(outputs, inputs, opts),
                             list(outputs) + [t for lst in inputs for t in lst])

    def reduce_scatter(self, outputs: list, inputs: list, opts: Any) -> EmulatedWork:
        return self._enqueue("reduce_scatter", lambda: self.gloo.reduce_scatter(outputs, inputs, opts),
                             list(outputs) + [t for lst in inputs for t in lst])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> EmulatedWork:  # noqa: A002
        return self._enqueue("_reduce_scatter_base", lambda: self.gloo._reduce_scatter_base(output, input, opts),
                             [output, input])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list,  # noqa: A002
                          input_splits: list, opts: Any) -> EmulatedWork:
        return self._enqueue("all_to_all_single",
                             lambda: self.gloo.alltoall_base(output, input, output_splits, input_splits, opts),
                             [output, input])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list, inputs: list, opts: Any) -> EmulatedWork:
        return self._enqueue("all_to_all", lambda: self.gloo.alltoall(outputs, inputs, opts),
                             list(outputs) + list(inputs))

    def barrier(self, opts: Any = None) -> EmulatedWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._enqueue("barrier", lambda: self.gloo.barrier(opts), [], blocking=True)

    def send(self, tensors: list, dst: int, tag: int = 0) -> EmulatedWork:
        return self._enqueue("send", lambda: self.gloo.send(tensors, dst, tag), tensors, peer=dst)

    def recv(self, tensors: list, src: int, tag: int = 0) -> EmulatedWork:
        return self._enqueue("recv", lambda: self.gloo.recv(tensors, src, tag), tensors, peer=src)

    def recv_anysource(self, tensors: list, tag: int = 0) -> EmulatedWork:
        return self._enqueue("recv", lambda: self.gloo.recv_anysource(tensors, tag), tensors, peer=-1)


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> EmulatedNCCL:
    return EmulatedNCCL(store, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("emulated_nccl")`` and ``new_group(backend="emulated_nccl")`` work (idempotent)."""
    if NAME.upper() not in dist.Backend.backend_list and NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
