"""The tracer's hot path: the function every traced collective runs (``traced_call``) and its enter step for a
call like one seen before (``fast_enter``: one dict lookup, one 32-byte slot). Everything else a call can need
(first calls, P2P, tensor lists, definitions) is ``Tracer``'s slow path. Its cost is measured side by side with
the bare collective by ``benchmarks/tracer_overhead.py``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from time import time_ns
from typing import TYPE_CHECKING, Any, Callable

from distcheck.files.trace import CHECK, SLOT_STRUCT, X_OK
from distcheck.knowledge.library_shapes import NUMBERED_APART
from distcheck.rank.guard import Hook, failed
from distcheck.rank.ops import MULTI_SEQ, OPS, UNCOUNTED, WAITED_HANDLES, OpSpec, make_extractor

if TYPE_CHECKING:
    from distcheck.rank.tracer import Tracer


def traced_call(tracer: Tracer, name: str, original: Callable, spec: OpSpec | None = None,
                signature_of: Callable | None = None) -> Callable:
    """``original`` traced as collective ``name``; ``signature_of``: read argument positions from this function
    instead (a stand-in collective with the real one's signature)."""
    spec = spec or OPS[name]
    extract = make_extractor(name, spec, list(inspect.signature(signature_of or original).parameters.values()))
    local, enter, writer = tracer._local, fast_enter(tracer, name, spec), tracer.writer
    append, pack, exit_check, getframe = writer.append, SLOT_STRUCT.pack, X_OK ^ CHECK, sys._getframe
    multi, waited, p2p = name in MULTI_SEQ, name in WAITED_HANDLES, spec.p2p is not None   # waited: isend, irecv
    apart = NUMBERED_APART.get(name)   # P2P, gloo's monitored_barrier: how many numbers it takes

    # Rule 0: distcheck's own error is counted, never raised into the user's call (a try is free until it raises).
    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if local.active:
            return original(*args, **kwargs)   # a collective inside a traced one
        local.active = True
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
                    t = time_ns()
                    record = pack(X_OK, key, t, exit_check ^ key ^ t)
                    try:
                        append(record)
                    except ValueError:    # the mapping is full: grow it
                        writer.write(record)
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
                tracer.busy_group = None   # after the numbers: the sidecar reads it first
            except Exception as exc:
                failed(Hook.TRACER, exc)
            local.active = False

    traced.__distcheck_original__ = original  # type: ignore[attr-defined]
    return traced


def fast_enter(tracer: Tracer, name: str, spec: OpSpec) -> Callable[[tuple, Any], int]:
    """The enter step for one op: a fast path for a call like one seen before (known group and fingerprint: one
    dict lookup, one slot), ``Tracer._enter`` for everything else (first calls, p2p, tensor lists, group ranks).
    The fast path's cache is keyed by a flat tuple of what the call shows (cheaper to build and hash than the
    fingerprint key): a key not seen yet takes ``_enter``, and the fingerprint it wrote is cached under it."""
    slow = functools.partial(tracer._enter, name, spec)
    if (spec.p2p or spec.tensor_lists or len(spec.tensors) > 1 or name in MULTI_SEQ or name in UNCOUNTED
            or spec.extra):
        return slow
    groups, seqs, op_ids, local = tracer._groups, tracer._seq, tracer._op_ids, tracer._local
    fast, site_key, default_group = tracer._fast.setdefault(name, {}), tracer.resolver.key, tracer._default_group
    writer = tracer.writer
    append, pack = writer.append, SLOT_STRUCT.pack
    learn = _learner(slow, fast, op_ids, site_key, local)

    def enter(values: tuple, frame: Any) -> int:
        pg, tensors, _, op, root, group_root, async_op, shape_unless, _, _ = values
        if group_root is not None:
            return slow(values, frame)
        entry = groups.get(id(default_group() if pg is None else pg))
        if op is not None:   # by identity: hashing a ReduceOp costs 0.1 µs
            named = op_ids.get(id(op))
            op = named[1] if named is not None and named[0] is op else None
            if op is None:
                return learn(values, frame)
        t = tensors[0] if tensors else None
        site = site_key(frame)
        # _seen's key, inline (a call costs 0.07 µs)
        seen = ((site, op, root, async_op, shape_unless is None) if t is None else
                (site, op, root, async_op, shape_unless is None, t.shape, t.dtype, t.device))
        fp = fast.get(seen)
        if fp is None or entry is None or (pg is not None and entry.pg is not pg):
            key = slow(values, frame)
            fast[seen] = local.last_fp
            return key
        group, counter = entry.key, entry.counter
        seq = (seqs[group] if counter is None else counter() - entry.base) + 1
        seqs[group] = seq
        entry.written.append(seq)
        tracer.busy_group = group
        tracer.count += 1
        key = entry.key_base + seq - entry.skew
        w0 = fp | entry.e_word
        t = time_ns()
        record = pack(w0, key, t, w0 ^ key ^ t ^ CHECK)
        try:
            append(record)
        except ValueError:    # the mapping is full: grow it
            writer.write(record)
        return key

    return enter


def _learner(slow: Callable, fast: dict, op_ids: dict, site_key: Callable, local: Any) -> Callable[[tuple, Any], int]:
    def learn(values: tuple, frame: Any) -> int:
        """A reduce op not seen yet: ``_enter`` names it, then the call is cached like any other."""
        key = slow(values, frame)
        named = op_ids.get(id(values[3]))
        if named is not None:
            _, tensors, _, _, root, _, async_op, shape_unless, _, _ = values
            fast[_seen(site_key(frame), named[1], root, async_op, shape_unless, tensors)] = local.last_fp
        return key
    return learn


def _seen(site: tuple, op: str | None, root: Any, async_op: Any, shape_unless: Any, tensors: tuple) -> tuple:
    """The fast path's key for a call: what it shows, flat (cheaper to build and hash than a fingerprint)."""
    t = tensors[0] if tensors else None
    return ((site, op, root, async_op, shape_unless is None) if t is None else
            (site, op, root, async_op, shape_unless is None, t.shape, t.dtype, t.device))
