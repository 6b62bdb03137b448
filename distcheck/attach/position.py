"""Where a rank stands, from a stack read from outside: inside a collective (the op from torch's
``distributed_c10d`` frame or a backend's native wait, the library entry point as the label, the user's
line), blocked in a device sync (NCCL: the host waits for work it enqueued, at ``loss.item()`` or
``torch.cuda.synchronize()``; the user's line that caused it), or outside every collective (its user line),
or gone. The same words the tracer records: the
user's frame is ``files.stacks.classify_file``'s, the label is ``rank.callsite``'s rule (the entry point
into the object that issued the call, ``BinaryAUROC.compute``). Pure."""

from __future__ import annotations

import enum
import re
import zlib
from dataclasses import dataclass

from distcheck.attach.read import Frame, StackRead, Thread
from distcheck.files.stacks import LIBRARY, TORCH, USER, classify_file
from distcheck.rank.ops import OPS

_C10D = "torch/distributed/distributed_c10d.py"
_SELF = re.compile(r"^<([A-Za-z_][\w.]*) at 0x[0-9a-f]+>$")
# Library methods that stand for "the module was called", as rank.callsite names them.
_NOT_OBJECTS = {"cell", "function", "method", "builtin_function_or_method"}   # a closure's self, not an object
_CALL_ENTRY = {"_wrapped_call_impl": "forward", "_call_impl": "forward"}
_WRAPPED = re.compile(r"_wrap_(\w+)\.<locals>")     # torchmetrics' compute/update wrappers
# A backend's wait in native frames, and the op each names (the Python thread may be elsewhere: DDP's
# reducer issues its all_reduce from autograd, NCCL's kernels run after Python has moved on).
_NATIVE_WAITS: tuple[tuple[str, str, None], ...] = (
    ("sync_bucket_indices", "broadcast", None), ("Reducer", "all_reduce", None), ("allreduce", "all_reduce", None),
    ("allgather", "all_gather", None), ("broadcast", "broadcast", None), ("barrier", "barrier", None),
    ("ProcessGroupGloo", "collective", None), ("ProcessGroupNCCL", "collective", None),
    ("cudaStreamSynchronize", "collective", None))
_BACKENDS = ("gloo", "ProcessGroupGloo", "ProcessGroupNCCL", "nccl", "c10d::")
# The host blocked in a device sync, in native frames: the CUDA runtime's and driver's waits (ROCm's too), named with
# torch's call that made it where its frame is there (``Tensor.item()`` is ``at::native::_local_scalar_dense_cuda``:
# a copy to the host, then a stream sync).
_SYNC_NATIVE = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
                "cuEventSynchronize", "cuCtxSynchronize", "cudaMemcpy", "cuMemcpyDtoH", "hipStreamSynchronize",
                "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy")
_SYNC_TORCH = (("_local_scalar_dense_cuda", "Tensor.item()"),
               ("THCPModule_cudaSynchronize", "torch.cuda.synchronize()"),
               ("c10::cuda::device_synchronize", "torch.cuda.synchronize()"),
               ("CUDAStream::synchronize", "a CUDA stream's synchronize()"),
               ("CUDAEvent::synchronize", "a CUDA event's synchronize()"),
               ("c10::cuda::memcpy_and_sync", "a copy to the host"), ("at::native::copy_", "a copy to the host"))
# ... and in Python frames: torch's synchronize functions (a C call below them), and emulated_nccl's stand-ins (its
# ``synchronize()`` draining the streams; a read of a tensor a pending call touches, waiting for that call).
_SYNC_PYTHON = {"torch/cuda/__init__.py": "torch.cuda", "torch/cuda/streams.py": "torch.cuda",
                "torch/accelerator/__init__.py": "torch.accelerator", "torch/xpu/__init__.py": "torch.xpu"}
_EMULATED = "distcheck/testing/emulated_nccl.py"
_EMULATED_WAITS = {"synchronize": "emulated_nccl.synchronize()", "drain": "emulated_nccl.synchronize()",
                   "wait_for": "a read of a tensor a pending emulated_nccl call touches"}


class Where(str, enum.Enum):
    """Where a rank was in one read: in a collective, in a device sync (NCCL's host waiting on the stream),
    outside both, gone (its process ended), or unreadable (the read failed)."""

    COLLECTIVE = "collective"
    DEVICE_SYNC = "device_sync"
    OUTSIDE = "outside"
    GONE = "gone"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Position:
    """Where one rank was in one read."""

    kind: Where
    op: str | None = None
    label: str | None = None
    callsite: str | None = None        # the user's innermost frame: file:line:function
    library_callsite: str | None = None
    native_wait: str | None = None     # the backend frame it waits in, when native frames were read
    digest: int = 0                    # the main thread's stack, to tell whether it moved
    stack: str = ""                    # every thread, for the report
    # The functions of the user's and libraries' code on the main thread (no line numbers, no standard library,
    # no torch): a loop polling in one function (``while not done(): time.sleep``) keeps them, work moves them.
    calls: int = 0
    active: bool = False               # the main thread was running (or runnable) when read
    sync: str | None = None            # "device_sync": the wait it is blocked in (``cudaStreamSynchronize``)


def frame_kind(filename: str) -> int:
    for mark in ("/site-packages/torch/", "/dist-packages/torch/"):
        if mark in filename:
            return classify_file(filename, filename[: filename.index(mark) + len(mark)])
    return classify_file(filename, "/torch/")


def position(read: StackRead) -> Position:
    """The rank's position from one read of its threads (the main thread decides)."""
    if read.error is not None:
        return Position(Where.UNREADABLE, stack=read.error)
    main = read.main()
    frames = main.frames if main else ()
    py = [f for f in frames if not f.native]
    digest = zlib.crc32("|".join(map(str, py)).encode())
    user, library = _sites(py)
    op, native, sync = _python_op(py), None, None
    if op is None:
        op, native = _native_op(frames)
    if op is None:
        sync = device_sync(frames)
    kind = Where.COLLECTIVE if op else Where.DEVICE_SYNC if sync else Where.OUTSIDE
    calls = zlib.crc32("|".join(f"{f.file}:{f.function}" for f in py if frame_kind(f.file) in (USER, LIBRARY))
                       .encode())
    return Position(kind, op, _label(py) if op else None, str(user) if user else None,
                    str(library) if library and op else None, native, digest, _text(read.threads), calls,
                    bool(main and main.active), sync)


def _sites(frames: list[Frame]) -> tuple[Frame | None, Frame | None]:
    user = next((f for f in frames if frame_kind(f.file) == USER), None)
    below = frames[: frames.index(user)] if user else frames
    return user or (frames[0] if frames else None), next((f for f in below if frame_kind(f.file) == LIBRARY), None)


def _python_op(frames: list[Frame]) -> str | None:
    for f in frames:
        name = f.function.rsplit(".", 1)[-1]
        if f.file.endswith(_C10D) and name in OPS:
            return name
    return None


def _native_op(frames: tuple[Frame, ...]) -> tuple[str | None, str | None]:
    native = [f for f in frames if f.native and any(b in f.function for b in _BACKENDS)]
    for f in native:
        for word, op, _ in _NATIVE_WAITS:
            if word.lower() in f.function.lower():
                return op, f.function
    return None, None


def device_sync(frames: tuple[Frame, ...]) -> str | None:
    """The device sync the thread is blocked in: a CUDA wait in native frames (with torch's call that made it, where
    its frame is there), torch's ``synchronize`` in Python frames, or emulated_nccl's waits (only while blocked: the
    innermost Python frame a ``threading`` wait). None: no device sync."""
    native = [f.function for f in frames if f.native]
    api = next((n.split("@")[0] for n in native if any(w in n for w in _SYNC_NATIVE)), None)
    made = next((words for marker, words in _SYNC_TORCH if any(marker in n for n in native)), None)
    if api or made:
        return f"{api} in {made}" if api and made else api or made
    py = [f for f in frames if not f.native]
    for f in py:
        name, path = f.function.rsplit(".", 1)[-1], f.file.replace("\\", "/")
        prefix = next((p for tail, p in _SYNC_PYTHON.items() if path.endswith(tail)), None)
        if prefix and name == "synchronize":
            return f"{prefix}.{f.function}()"
        if path.endswith(_EMULATED) and name in _EMULATED_WAITS:
            return _EMULATED_WAITS[name] if py[0].function.rsplit(".", 1)[-1] == "wait" else None
    return None


def _label(frames: list[Frame]) -> str | None:
    """``Class.method``: the class of the innermost library object on the stack, the method the user called
    on it (the outermost library frame below the user's)."""
    user_at = next((i for i, f in enumerate(frames) if frame_kind(f.file) == USER), len(frames))
    inside = [f for f in frames[:user_at] if frame_kind(f.file) in (LIBRARY, TORCH)]
    cls = next((m.group(1) for f in inside if f.self_repr and (m := _SELF.match(f.self_repr))
                and m.group(1) not in _NOT_OBJECTS), None)
    entry = next((f for f in reversed(inside) if frame_kind(f.file) == LIBRARY or "nn/modules" in f.file), None)
    if cls is None or entry is None:
        return None
    wrapped = _WRAPPED.search(entry.function)
    method = wrapped.group(1) if wrapped else entry.function.split(".<locals>")[0].rsplit(".", 1)[-1]
    return f"{cls.rsplit('.', 1)[-1]}.{_CALL_ENTRY.get(method, method)}"


def _text(threads: tuple[Thread, ...]) -> str:
    out = []
    for t in threads:
        out.append(f"Thread {t.os_id} ({t.name or 'unnamed'}):")
        out += [f"  {f.function} ({f.file}:{f.line})" if not f.native else f"  {f.function} [native]"
                for f in t.frames]
    return "\n".join(out)
