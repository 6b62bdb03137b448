"""The tracer's hot path: the function every traced collective runs (``traced_call``).

A collective on one tensor (or none) on a process group — ``all_reduce``, ``broadcast``, ``barrier``... — gets a
wrapper generated from the op's own signature (``_FAST_SOURCE``), in which a call like one seen before costs one
Python frame: its arguments read in place, one dict lookup for its fingerprint, the group's counter for its
number, and one 32-byte slot before and after the call. Why one frame: after a blocking collective the rank's
caches are cold (other processes ran while it waited), and there every extra frame, call or object costs a few
times what it costs in a warm loop (``benchmarks/tracer_overhead.py`` measures it beside the real call).
Everything else a call can need (first calls, P2P, tensor lists, definitions) is ``Tracer``'s slow path, which
P2P and list collectives take every time through ``_traced``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from pathlib import Path
from time import time_ns
from typing import TYPE_CHECKING, Any, Callable

from distcheck.files.trace import CHECK, SLOT_STRUCT, X_OK
from distcheck.knowledge.library_shapes import NUMBERED_APART
from distcheck.rank.guard import Hook, failed
from distcheck.rank.ops import (MULTI_SEQ, OPS, UNCOUNTED, WAITED_HANDLES, OpSpec, arg_places, arg_reader,
                                make_extractor)

if TYPE_CHECKING:
    from distcheck.rank.tracer import Tracer

_HERE = str(Path(__file__).resolve())


def traced_call(tracer: Tracer, name: str, original: Callable, spec: OpSpec | None = None,
                signature_of: Callable | None = None) -> Callable:
    """``original`` traced as collective ``name``; ``signature_of``: read argument positions from this function
    instead (a stand-in collective with the real one's signature)."""
    spec = spec or OPS[name]
    params = list(inspect.signature(signature_of or original).parameters.values())
    extract = make_extractor(name, spec, params)
    if has_fast_path(name, spec):
        traced = _fast_traced(tracer, name, spec, original, extract, params)
    else:
        traced = _traced(tracer, name, spec, original, extract)
    functools.update_wrapper(traced, original)
    traced.__distcheck_original__ = original  # type: ignore[attr-defined]
    return traced


def has_fast_path(name: str, spec: OpSpec) -> bool:
    """Whether a call of this op can be recorded from what it shows alone: one tensor or none, numbered by its
    group's counter (not P2P, not several collectives in one, not ``new_group``), nothing read on the side."""
    return not (spec.p2p or spec.tensor_lists or len(spec.tensors) > 1 or name in MULTI_SEQ or name in UNCOUNTED
                or spec.extra or spec.shape_unless or spec.object_list or name in NUMBERED_APART)


def _traced(tracer: Tracer, name: str, spec: OpSpec, original: Callable, extract: Callable) -> Callable:
    """The wrapper of an op without a fast path: every call takes ``Tracer._enter``."""
    inside, hot, writer = tracer._inside, tracer.hot, tracer.writer
    enter = functools.partial(tracer._enter, name, spec)
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
                key = enter(values, getframe(1))
                if apart is not None:
                    mark = tracer._mark(values[0])
            except Exception as exc:
                key, unrecorded = None, exc
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                if key is not None:
                    tracer._exit_guarded(key, exc)
                raise   # the user's exception, as it was
            if key is not None:
                try:
                    _write(writer, X_OK, key, time_ns())
                    if waited or (values[6] and result is not None):   # a handle: its wait() is recorded
                        tracer._hold((result,), (key,))
                except Exception as exc:
                    failed(Hook.TRACER, exc)
            elif unrecorded is not None:   # counted for a call that worked (a malformed call is the user's)
                failed(Hook.TRACER, unrecorded)
            return result
        finally:
            try:
                if multi:
                    tracer._resync()
                if mark is not None:
                    tracer._settle(mark, apart, p2p)
                hot.busy_group = None   # after the numbers: the sidecar reads it first
            except Exception as exc:
                failed(Hook.TRACER, exc)
            inside.active = False

    return traced


def _write(writer: Any, w0: int, key: int, t: int) -> None:
    record = SLOT_STRUCT.pack(w0, key, t, w0 ^ key ^ t ^ CHECK)
    try:
        writer.append(record)
    except ValueError:    # the mapping is full: grow it
        writer.write(record)


# The wrapper of an op with a fast path, generated per op: {reads} reads its arguments in place, {seen} is the
# fast path's key for a call (what the call shows, flat: cheaper to build and hash than a fingerprint), {usable}
# whether the call can have one. A call whose key is cached, on a group already defined, is numbered and written
# here; any other takes ``slow`` (``Tracer._enter``), which caches the fingerprint it wrote under the key.
# The key's site is the calling function's code and instruction where that function is the user's own and no
# module method (``CallsiteResolver.plain_user``: its site is then its own line), else ``CallsiteResolver.key``.
# Reduce ops are in the key by id, only while ``op_ids`` keeps the op alive (its id cannot be reused), or the
# signature's default op (``op_default``: kept alive by the signature).
_FAST_SOURCE = '''
def traced(*args, **kwargs):
    if inside.active:
        return original(*args, **kwargs)   # a collective inside a traced one
    inside.active = True
    key = unrecorded = None
    try:
        try:
            n = len(args)
{reads}
            frame = getframe(1)
            seen = fp = entry = None
            if {usable}:
                code = frame.f_code
                if plain_user.get(id(code)) is code:
                    seen = (id(code), frame.f_lasti, {seen})
                else:
                    seen = (site_key(frame), None, {seen})
                if op is None or op is op_default or (op_ids.get(id(op)) or NO_OP)[0] is op:
                    fp = fast.get(seen)
            if fp is not None:
                entry = groups.get(id(default_group() if pg is None else pg))
            if entry is None:
                key = slow(args, kwargs, frame, seen, op)
            else:
                group, counter = entry.key, entry.counter
                if counter is None:
                    seq = seqs[group] + 1
                    seqs[group] = seq
                else:   # the sidecar learns the number is a Python call's, and the group busy meanwhile
                    seq = counter() - entry.base + 1
                    entry.written.append(seq)
                    hot.busy_group = group
                hot.count += 1
                k = entry.key_base + seq - entry.skew
                w0 = fp | entry.e_word
                t = time_ns()
                record = pack(w0, k, t, w0 ^ k ^ t ^ CHECK)
                try:
                    append(record)
                except ValueError:    # the mapping is full: grow it
                    writer.write(record)
                key = k
        except Exception as exc:
            key, unrecorded = None, exc
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            if key is not None:
                tracer._exit_guarded(key, exc)
            raise   # the user's exception, as it was
        if key is not None:
            try:
                t = time_ns()
                record = pack(X_OK, key, t, exit_check ^ key ^ t)
                try:
                    append(record)
                except ValueError:    # the mapping is full: grow it
                    writer.write(record)
                if async_op and result is not None:   # a handle: its wait() is recorded
                    tracer._hold((result,), (key,))
            except Exception as exc:
                failed(Hook.TRACER, exc)
        elif unrecorded is not None:   # counted for a call that worked (a malformed call is the user's)
            failed(Hook.TRACER, unrecorded)
        return result
    finally:
        hot.busy_group = None   # after the numbers: the sidecar reads it first
        inside.active = False
'''


def _fast_traced(tracer: Tracer, name: str, spec: OpSpec, original: Callable, extract: Callable,
                 params: list[inspect.Parameter]) -> Callable:
    """The generated wrapper of an op with a fast path (``_FAST_SOURCE``)."""
    read, namespace = arg_reader(params)
    tensor = spec.tensors[0] if spec.tensors else None
    reads = {"pg": read("group"), "t": read(tensor), "op": read(spec.reduce_op), "root": read(spec.root),
             "group_root": read(spec.group_root), "async_op": read("async_op")}
    seen = (["id(op)"] if spec.reduce_op else []) + (["root"] if spec.root else []) + ["async_op"]
    # A CPU tensor's device as True, read without making a torch.device (the fingerprint keeps the device's type).
    seen += ["t.shape", "t.dtype", "t.is_cpu or t.device"] if tensor else []
    usable = "group_root is None" + (" and t is not None" if tensor else "")
    source = _FAST_SOURCE.format(reads="\n".join(f"            {var} = {expr}" for var, expr in reads.items()),
                                 seen=", ".join(seen), usable=usable)
    writer = tracer.writer
    namespace.update(
        inside=tracer._inside, hot=tracer.hot, original=original, tracer=tracer, writer=writer, append=writer.append,
        pack=SLOT_STRUCT.pack, CHECK=CHECK, X_OK=X_OK, exit_check=X_OK ^ CHECK, time_ns=time_ns,
        getframe=sys._getframe, plain_user=tracer.resolver.plain_user, site_key=tracer.resolver.key,
        op_ids=tracer._op_ids, NO_OP=(None,), op_default=_default_op(params, spec), fast=tracer._fast.setdefault(name, {}), groups=tracer._groups,
        default_group=tracer._default_group, seqs=tracer._seq, failed=failed, Hook=Hook,
        slow=_slow(tracer, name, spec, extract))
    # Named as a file of distcheck's (``hot_path.py<all_reduce>``), so stacks and tracebacks leave its frame out.
    exec(compile(source, f"{_HERE}<{name}>", "exec"), namespace)  # noqa: S102 - from the op's signature
    traced = namespace["traced"]
    c_path = tracer.c_path
    if c_path is None:
        return traced
    functools.update_wrapper(traced, original)   # its repr and tracebacks name the collective
    places = arg_places(params)

    def where(param: str | None) -> tuple[int, str, Any] | None:   # (position, name, default), as the wrapper reads it
        return None if param is None or param not in places else (places[param][0], param, places[param][1])

    n = namespace
    call = c_path.FastCall(
        fallback=traced, original=original, tracer=tracer, inside=n["inside"], hot=n["hot"], append=n["append"],
        write=writer.write, plain_user=n["plain_user"], site_key=n["site_key"], op_ids=n["op_ids"],
        op_default=n["op_default"], fast=n["fast"], groups=n["groups"], default_group=n["default_group"],
        seqs=n["seqs"], failed=failed, hook=Hook.TRACER,
        params=tuple(where(p) for p in ("group", tensor, spec.reduce_op, spec.root, spec.group_root, "async_op")),
        has_op=bool(spec.reduce_op), has_root=bool(spec.root), has_tensor=bool(tensor), check=CHECK, x_ok=X_OK,
        cursor=writer.cursor)
    tracer._fast_calls.add(call)   # it remembers its last call: forgotten when the tracer clears its keys
    return call


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
        from distcheck.rank import _hot_path_c
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


def _slow(tracer: Tracer, name: str, spec: OpSpec, extract: Callable) -> Callable[..., int]:
    """The fast wrapper's other path: ``Tracer._enter``, then the fingerprint it wrote cached under the call's key
    (``seen``: None where the call cannot have one), where the key's reduce op is one ``op_ids`` keeps alive."""
    enter, fast, op_ids, local = functools.partial(tracer._enter, name, spec), tracer._fast.setdefault(name, {}), \
        tracer._op_ids, tracer._local
    plain_user = tracer.resolver.plain_user

    def slow(args: tuple, kwargs: dict, frame: Any, seen: tuple | None, op: Any) -> int:
        key = enter(extract(args, kwargs), frame)
        if seen is not None and (op is None or (op_ids.get(id(op)) or (None,))[0] is op):
            fp = fast[seen] = local.last_fp
            code = frame.f_code
            if plain_user.get(id(code)) is code:   # a function first seen now: its next call's key is the short one
                fast[(id(code), frame.f_lasti) + seen[2:]] = fp
        return key

    return slow
