"""The tracer's hot path: the function every traced collective runs (``traced_call``), in one of two forms that write
the same records:

* **C** (``hot_path_c/``, wherever a C compiler was at install): a collective on one tensor (or none) on a process
  group — ``all_reduce``, ``broadcast``, ``barrier``... — that was seen before is read, numbered and written by
  ``FastCall`` without a Python frame: after a blocking collective the rank's caches are cold, and there every extra
  frame, call or object costs a few times what it costs in a warm loop (``benchmarks/tracer_overhead.py``).
* **Python** (``_traced``): every other call, and every call where the C module is not built: the tracer's slow path
  (``Tracer.enter``, through ``HotPathState``) writes the call and, for an op the C path records, files the
  fingerprint under the key the C path computes for it (``CKeys``), so the next call like it is the C path's.

One record write: both end in the same records, byte for byte but for their times
(``tests/test_hot_path_differential.py`` drives random call streams through both and compares the traces).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from time import time_ns
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from distcheck.files.trace import CHECK, SLOT_STRUCT, X_OK
from distcheck.knowledge.library_shapes import NUMBERED_APART
from distcheck.rank.ops import (MULTI_SEQ, OPS, UNCOUNTED, WAITED_HANDLES, CallArgs, OpSpec, Place, arg_places,
                                make_extractor)

if TYPE_CHECKING:
    from distcheck.rank.handles import Handles
    from distcheck.rank.numbering import Numbering


class KnownOp(NamedTuple):
    """A reduce op the C path knows by identity (``HotPathState.op_ids``; ``fast_key.c`` reads ``op`` as item 0)."""

    op: Any      # kept alive, so its id stays its own
    name: str


class LastWritten(threading.local):
    fp = 0   # the fingerprint this thread's last slow-path call wrote (the C path's key is filed to it)


@dataclass(frozen=True, slots=True, eq=False)
class HotPathState:
    """What a traced call reads and writes, built once by the tracer (``Tracer.hot_path``) and shared by every
    wrapper, Python and C (``FastCall`` reads its fields when it is made)."""

    c_path: Any                 # the C module (``_hot_path_c``), or None: the Python wrapper alone
    inside: Any                 # ``.active``: this thread is inside a traced call (``thread_flag``)
    hot: Any                    # ``busy_group`` and ``count`` (``hot_state``): the sidecar reads them
    writer: Any                 # the trace's ``TraceWriter``: ``append``, ``write``, ``cursor``
    numbering: Numbering        # ``groups``, ``seqs``, ``default_group`` (C); ``mark``, ``settle``, ``resync``
    handles: Handles            # ``hold(works, keys)``: an async call's handle, its wait recorded
    enter: Callable[[str, OpSpec, CallArgs, Any], int]   # the slow path: ``(name, spec, args, frame) -> call key``
    exit_guarded: Callable[[int, BaseException | None], None]   # the exit record (rule 0: never raises)
    failed: Callable[[BaseException], None]   # distcheck's own error, counted (``guard.failed(Hook.TRACER, ...)``)
    fast: dict[str, dict[tuple, int]]   # op -> the C path's key -> the fingerprint the slow path wrote
    op_ids: dict[int, KnownOp]          # id(reduce op) -> the op: ops the C path knows by identity
    last_written: LastWritten
    plain_user: dict[int, Any]          # ``CallsiteResolver.plain_user``: the user's own functions, by id(code)
    site_key: Callable[[Any], tuple]    # ``CallsiteResolver.key``
    fast_calls: weakref.WeakSet         # the C path's wrappers: they forget their last call with the tracer's keys
    check: ClassVar[int] = CHECK        # the records' check word and X record word, as the C path packs them
    x_ok: ClassVar[int] = X_OK


def traced_call(state: HotPathState, name: str, original: Callable, spec: OpSpec | None = None,
                signature_of: Callable | None = None) -> Callable:
    """``original`` traced as collective ``name``; ``signature_of``: read argument positions from this function
    instead (a stand-in collective with the real one's signature)."""
    spec = spec or OPS[name]
    params = list(inspect.signature(signature_of or original).parameters.values())
    extract = make_extractor(name, spec, params)
    keys = CKeys(state, name, spec, params) if has_fast_path(name, spec) and state.c_path is not None else None
    traced = _traced(state, name, spec, original, extract, keys)
    functools.update_wrapper(traced, original)
    traced.__distcheck_original__ = original  # type: ignore[attr-defined]
    if keys is None:
        return traced
    call = state.c_path.FastCall(state, keys, traced, original)   # ``traced``: every call it does not record itself
    functools.update_wrapper(call, original)   # its repr, name and __wrapped__ are the collective's
    call.__distcheck_original__ = original
    state.fast_calls.add(call)   # it remembers its last call: forgotten when the tracer clears its keys
    return call


def has_fast_path(name: str, spec: OpSpec) -> bool:
    """Whether a call of this op can be recorded from what it shows alone: one tensor or none, numbered by its
    group's counter (not P2P, not several collectives in one, not ``new_group``), nothing read on the side."""
    return not (spec.p2p or spec.tensor_lists or len(spec.tensors) > 1 or name in MULTI_SEQ or name in UNCOUNTED
                or spec.extra or spec.shape_unless or spec.object_list or name in NUMBERED_APART)


def _traced(state: HotPathState, name: str, spec: OpSpec, original: Callable, extract: Callable[..., CallArgs],
            keys: CKeys | None = None) -> Callable:
    """The Python wrapper: every call takes the slow path (``state.enter``); ``keys``: file what it wrote for the C
    path."""
    inside, hot, writer, numbering, handles = state.inside, state.hot, state.writer, state.numbering, state.handles
    enter, exit_guarded, failed = functools.partial(state.enter, name, spec), state.exit_guarded, state.failed
    multi, waited, p2p = name in MULTI_SEQ, name in WAITED_HANDLES, spec.p2p is not None   # waited: isend, irecv
    apart = NUMBERED_APART.get(name)   # P2P, gloo's monitored_barrier: how many numbers it takes
    getframe = sys._getframe

    # Rule 0: distcheck's own error is counted, never raised into the user's call (a try is free until it raises).
    def traced(*args: Any, **kwargs: Any) -> Any:
        if inside.active:
            return original(*args, **kwargs)   # a collective inside a traced one
        inside.active = True
        mark = unrecorded = None
        try:
            try:
                values = extract(args, kwargs)
                frame = getframe(1)
                key = enter(values, frame)
                if keys is not None:
                    keys.remember(args, kwargs, frame)
                if apart is not None:
                    mark = numbering.mark(values.group)
            except Exception as exc:
                key, unrecorded = None, exc
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                if key is not None:
                    exit_guarded(key, exc)
                raise   # the user's exception, as it was
            if key is not None:
                try:
                    _write(writer, X_OK, key, time_ns())
                    if waited or (values.async_op and result is not None):   # a handle: its wait() is recorded
                        handles.hold((result,), (key,))
                except Exception as exc:
                    failed(exc)
            elif unrecorded is not None:   # counted for a call that worked (a malformed call is the user's)
                failed(unrecorded)
            return result
        finally:
            try:
                if multi:
                    numbering.resync()
                if mark is not None and apart is not None:   # a mark is taken only for a call numbered apart
                    numbering.settle(mark, apart, p2p)
                hot.busy_group = None   # after the numbers: the sidecar reads it first
            except Exception as exc:
                failed(exc)
            inside.active = False

    return traced


def _write(writer: Any, w0: int, key: int, t: int) -> None:
    record = SLOT_STRUCT.pack(w0, key, t, w0 ^ key ^ t ^ CHECK)
    try:
        writer.append(record)
    except ValueError:    # the mapping is full: grow it
        writer.write(record)


class Places(NamedTuple):
    """Where the C path reads each argument it knows a call by (None where the signature lacks it)."""

    group: Place | None
    tensor: Place | None
    reduce_op: Place | None
    root: Place | None
    group_root: Place | None
    async_op: Place | None

    def read(self, args: tuple, kwargs: dict) -> Any:
        """The call's arguments, one per field, as the C path reads them (``fast_key.c``: ``read_arg``): a
        ``Places`` that holds the values (whatever the user passed), not places."""
        return Places._make(_read(args, kwargs, place) for place in self)


class CKeys:
    """The key the C path computes for a call (``fast_key.c``: ``seen_key``), and the fingerprint the slow path wrote
    filed under it: what the call shows, flat (its site, then its reduce op by id, root, async flag and tensor's
    shape, dtype and place). The site is the calling function's code and instruction where that function is the
    user's own and no module method (``CallsiteResolver.plain_user``), else ``CallsiteResolver.key``; a reduce op
    only while ``op_ids`` keeps it alive (its id cannot be reused), or the signature's default op. One per op;
    ``FastCall`` reads ``places``, ``has_*``, ``op_default`` and ``fast`` when it is made."""

    __slots__ = ("places", "has_op", "has_root", "has_tensor", "op_default", "fast", "state")

    def __init__(self, state: HotPathState, name: str, spec: OpSpec, params: list[inspect.Parameter]) -> None:
        places = arg_places(params)
        self.places = Places(*(places.get(p) if p else None for p in (
            "group", spec.tensors[0] if spec.tensors else None, spec.reduce_op, spec.root, spec.group_root,
            "async_op")))
        self.has_op, self.has_root, self.has_tensor = bool(spec.reduce_op), bool(spec.root), bool(spec.tensors)
        self.op_default = _default_op(params, spec)
        self.fast = state.fast.setdefault(name, {})
        self.state = state

    def remember(self, args: tuple, kwargs: dict, frame: Any) -> None:
        """After the slow path wrote a call: its fingerprint under the C path's key, where the call can have one."""
        shown = self.places.read(args, kwargs)
        t, op = shown.tensor, shown.reduce_op
        if shown.group_root is not None or (self.has_tensor and t is None) or not self._op_known(op):
            return
        key: tuple = ((id(op),) if self.has_op else ()) + ((shown.root,) if self.has_root else ()) + (shown.async_op,)
        if self.has_tensor:
            key += (t.shape, t.dtype, t.is_cpu or t.device)
        fp = self.state.last_written.fp
        site_key = (self.state.site_key(frame), None, *key)
        self.fast[site_key] = fp
        code = frame.f_code
        if self.state.plain_user.get(id(code)) is code:   # the user's own function: the short key, code and instruction
            code_key = (id(code), frame.f_lasti, *key)
            self.fast[code_key] = fp

    def _op_known(self, op: Any) -> bool:
        if not self.has_op or op is None or op is self.op_default:
            return True
        known = self.state.op_ids.get(id(op))
        return known is not None and known.op is op


def _read(args: tuple, kwargs: dict, place: Place | None) -> Any:
    if place is None:
        return None
    return args[place.index] if 0 <= place.index < len(args) else kwargs.get(place.name, place.default)


class PythonThreadFlag(threading.local):
    active = False   # inside a traced call on this thread


def thread_flag(c_path: Any) -> Any:
    """"Inside a traced call on this thread" (``.active``), which every wrapper reads before it records a call, so a
    collective issued inside a traced one is not recorded twice: one thread-specific value in C where the tracer
    uses the C hot path (``c_path``), else a ``threading.local``."""
    return c_path.ThreadFlag() if c_path is not None else PythonThreadFlag()


class PythonHotState:
    """The tracer's busy group and call count where the hot path is Python's (``_hot_path_c.HotState`` in C)."""

    __slots__ = ("busy_group", "count")

    def __init__(self) -> None:
        self.busy_group: str | None = None   # the group a Python call is in right now (the sidecar reads it)
        self.count = 0                       # calls recorded


def hot_state(c_path: Any) -> Any:
    """The two values every recorded call sets, ``busy_group`` and ``count``: in a C object where the tracer uses the
    C hot path (``c_path``), which sets them with a store each, else a plain one. ``Tracer`` reads them through."""
    return c_path.HotState() if c_path is not None else PythonHotState()


def c_hot_path() -> Any:
    """The hot path in C (``_hot_path_c``), or None: not built here (no C compiler where distcheck was installed),
    or ``DISTCHECK_HOT_PATH=python``. The Python wrapper records the same calls then. A tracer asks once."""
    if os.environ.get("DISTCHECK_HOT_PATH", "").lower() == "python":
        return None
    try:
        import distcheck.rank._hot_path_c as _hot_path_c
    except ImportError:
        return None
    return _hot_path_c


def _default_op(params: list[inspect.Parameter], spec: OpSpec) -> Any:
    """The signature's default reduce op (``ReduceOp.SUM``), known by identity without a lookup: the signature keeps
    it alive, so its id in the fast path's key stays its own. A stand-in object where there is none."""
    for p in params:
        if p.name == spec.reduce_op and p.default is not p.empty and p.default is not None:
            return p.default
    return object()
