"""The per-rank collective tracer.

Wraps every public collective and p2p call of ``torch.distributed`` (the
``torch.distributed`` attribute and ``distributed_c10d``), and records for each
call an *enter* record before the backend sees it and an *exit* record after.
torchmetrics and Lightning call collectives through the module attribute, so
installing the tracer before user code runs sees their calls too.

Hot path rules: no locks, no store round trips, no system call: each record
is one 32-byte slot packed straight into the memory-mapped trace file.
What a call costs on top of the collective (see benchmarks/tracer_overhead.py):

* arguments are read by a small function generated per op from its signature
  (positions known in advance), not by binding ``dict(zip(params, args))``;
* the call's whole fingerprint — op, reduce op, shapes, dtypes, device, root,
  async flag, call site — is a tuple of cheap objects looked up in a dict; only
  a fingerprint never seen before is formatted (an ``F`` record, see
  ``distcheck.files.trace``), so a repeated call writes one slot of four ints;
* the call site is found by ``CallsiteResolver.key``, which caches everything
  per code object;
* the two records of a call are ``struct`` packs appended with the
  mapping's own ``write`` (0.04 µs each, where an ``os.write`` was 0.6).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import weakref
from collections import deque
from time import time_ns
from typing import Any, Callable

from distcheck.files.trace import (FP_SHIFT, NONE, SEQ_BITS, TAG_E, RecordBatch, encode_shapes, enter_slot,
                                   error_record, exit_slot, fingerprint_record, segment_record, site_record,
                                   text_slots)
from distcheck.files.trace_writer import TraceWriter
from distcheck.rank.callsite import CallsiteResolver
from distcheck.rank.groups import c10d_default_group, c10d_group, group_counters
from distcheck.rank.guard import Hook, failed
from distcheck.rank.handles import Handles, HeldHandle
from distcheck.rank.hot_path import c_hot_path, hot_state, thread_flag, traced_call
from distcheck.rank.numbering import GroupEntry, Mark, Numbering
from distcheck.rank.ops import ASYNC_BY_NATURE, OPS, OpSpec, extra_fields, reduce_op_name


# Reduce op objects the fast path knows by identity; others (one made per call) take the slow path.
MAX_FAST_OPS = 64


class _Local(threading.local):
    last_fp = 0             # the fingerprint this thread's last slow-path call wrote


class Tracer(Numbering, Handles):
    """Records collectives of one rank into its trace file: what is installed and the slow path here, the hot
    path in ``rank.hot_path``, the numbering in ``rank.numbering``, P2P handles in ``rank.handles``.

    ``group_resolver(pg) -> (key, ranks)`` names a process group and
    ``default_group()`` returns the group a call without ``group=`` uses; both
    ask ``distributed_c10d`` unless given (benchmarks and tests pass their own
    to trace without a process group).
    """

    def __init__(self, path: Any, rank: int,
                 group_resolver: Callable[[Any], tuple[str, tuple[int, ...]]] | None = None,
                 default_group: Callable[[], Any] | None = None) -> None:
        from pathlib import Path

        self.rank = rank
        self.c_path = c_hot_path()   # the hot path in C, or None (the Python wrapper): one choice for every wrapper
        self.writer = TraceWriter(Path(path), cursor_type=self.c_path.SlotCursor if self.c_path is not None else None)
        self.resolver = CallsiteResolver()
        self._resolve_group = group_resolver or c10d_group
        self._default_group = default_group or c10d_default_group()
        # group -> the newest number this tracer wrote (the group's own counter where it has one)
        self._seq: dict[str, int] = {}
        self._groups: dict[int, GroupEntry] = {}   # id(pg) -> the group as the numbering knows it
        self._gids: dict[str, int] = {}     # group (or p2p pair) -> its id in the trace
        self._written: dict[str, deque] = {}
        # Numbers count from each group's counter when tracing started (0 for groups made later).
        self._bases: dict[str, int] = {key: counter() for key, counter in group_counters()}
        self._multi: tuple[str, Callable[[], int], int] | None = None   # (group, counter, base) of a MULTI_SEQ call
        # group -> counter numbers taken by calls outside the collective numbering (P2P, gloo's
        # monitored_barrier: distcheck.knowledge.library_shapes), as ([from offset, ...], [skew from there, ...])
        self._skews: dict[str, tuple[list[int], list[int]]] = {}
        # Shared with the sidecar that finds C++-issued calls (rank.native): the group a Python call
        # is in right now (``busy_group``: its numbers are its own), and a lock held while a new segment starts.
        self.hot = hot_state(self.c_path)   # busy_group and count, set by every recorded call
        self.lock = threading.Lock()
        self.segment_listeners: list[Any] = []   # end_segment() before the B record, reset() after
        self._sites: dict[tuple, str] = {}
        self._fps: dict[tuple, int] = {}   # fingerprint -> its id << FP_SHIFT | TAG_E
        self._error_ids = 0
        self._op_names: dict[Any, str] = {}
        self._op_ids: dict[int, tuple[Any, str]] = {}   # id(reduce op) -> (the op, kept alive; its name)
        self._fast: dict[str, dict[tuple, int]] = {}    # op -> the fast path's key -> fingerprint
        self._fast_calls: weakref.WeakSet = weakref.WeakSet()   # the C hot path's wrappers (rank.hot_path)
        # Held while a call takes the slow path: an id is registered, then written, and no other thread may
        # use it in between (a record naming a group not defined yet cannot be read).
        self._defining = threading.Lock()
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=functools.partial(_in_forked_child, me))
        self._local = _Local()
        self._inside = thread_flag(self.c_path)   # this thread is inside a traced call
        self._originals: dict[str, Callable] = {}
        # id(work) -> (a weak reference to it, the call keys it completes): the handles of P2P calls, whose
        # ``wait()`` is written as W records (the rank is blocked in those calls while it waits)
        self._handles: dict[int, HeldHandle] = {}
        self._work_wait: tuple[Any, Callable, Callable] | None = None   # (torch's Work class, its own wait, ours)
        self._wait_armed = False   # ours in place: while a handle is held (rank.handles)
        self._wait_lock = threading.Lock()
        self.slow_calls = 0   # calls that took ``_enter`` (first of their kind, p2p, lists...): a cost to watch

    @property
    def busy_group(self) -> str | None:
        """The group a Python call is in right now (its numbers are its own), or None."""
        return self.hot.busy_group

    @busy_group.setter
    def busy_group(self, group: str | None) -> None:
        self.hot.busy_group = group

    @property
    def count(self) -> int:
        """Calls recorded."""
        return self.hot.count

    @count.setter
    def count(self, n: int) -> None:
        self.hot.count = n

    def _forget_remembered_calls(self) -> None:
        """The C hot path's wrappers drop the last call each remembers (its key, group and the group's fields)."""
        for call in self._fast_calls:
            call.forget()

    def begin_segment(self, name: str) -> None:
        """Start a self-contained part of the trace (the next scenario of a batched launch).

        Sequence numbers restart (counted from each group's counter now) and every
        definition is written again after the ``B`` record, so each part parses on
        its own (``distcheck.files.trace_reader.split_segments``).
        """
        with self.lock:
            for listener in self.segment_listeners:
                listener.end_segment()
            self._bases = {key: counter() for key, counter in group_counters()}
            self._seq.clear()
            self._skews.clear()
            self._groups.clear()
            self._gids.clear()
            self._written.clear()
            self._handles.clear()   # their keys name the finished segment's calls
            self._sites.clear()
            self._fps.clear()
            for cache in self._fast.values():
                cache.clear()
            self._forget_remembered_calls()   # they name cleared keys and groups
            self.writer.write(segment_record(name))
            for listener in self.segment_listeners:
                listener.reset()

    # -- installation -------------------------------------------------------

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, spec in OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapper = self.wrap(name, original, spec)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        original = getattr(c10d, "batch_isend_irecv", None)
        if original is not None:
            self._originals["batch_isend_irecv"] = original
            wrapper = self._wrap_batch(original)
            c10d.batch_isend_irecv = wrapper
            dist.batch_isend_irecv = wrapper
        work = getattr(c10d, "Work", None)
        original = getattr(work, "wait", None)
        if original is not None and self._work_wait is None:
            self._install_wait(work, original)

    def uninstall(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()
        if self._work_wait is not None:
            self._give_back_wait(unless_held=False)
            self._work_wait = None

    def close(self) -> None:
        self.writer.close()

    # -- wrapping -----------------------------------------------------------

    def wrap(self, name: str, original: Callable, spec: OpSpec | None = None,
             signature_of: Callable | None = None) -> Callable:
        """``original`` traced as collective ``name`` (the code path ``install`` uses); ``signature_of``: read
        argument positions from this function instead (a stand-in collective with the real one's signature)."""
        return traced_call(self, name, original, spec, signature_of)

    def _wrap_batch(self, original: Callable) -> Callable:
        inside = self._inside

        @functools.wraps(original)
        def traced(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
            if inside.active:
                return original(p2p_op_list, *args, **kwargs)
            inside.active = True
            claims: list[Mark] = []
            keys: list[int] = []
            try:
                try:   # rule 0, as in wrap()
                    frame = sys._getframe(1)
                    for p2p in p2p_op_list:
                        keys.append(self._enter_p2p_op(p2p, frame))
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                try:   # unrecorded or not, the batch's numbers are not C++-issued collectives
                    claims = self._batch_counters(p2p_op_list)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                try:
                    result = original(p2p_op_list, *args, **kwargs)
                except BaseException as exc:
                    for key in keys:
                        self._exit_guarded(key, exc)
                    raise   # the user's exception, as it was
                for key in keys:
                    self._exit_guarded(key, None)
                try:
                    self._hold(result, keys)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                return result
            finally:
                try:
                    self._claim_batch(claims)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                inside.active = False

        traced.__distcheck_original__ = original  # type: ignore[attr-defined]
        return traced

    # -- records ------------------------------------------------------------

    def _after_fork(self) -> None:
        self._defining = threading.Lock()   # another thread of the parent may have held it
        self._wait_lock = threading.Lock()

    def _enter(self, name: str, spec: OpSpec, values: tuple, frame: Any, claim: bool = True) -> int:
        """Write the enter record and its new definitions; return the call key its exit record repeats.
        The fingerprint it wrote is left in ``self._local.last_fp`` (the fast path caches it)."""
        with self._defining:
            return self._enter_defining(name, spec, values, frame, claim)

    def _enter_defining(self, name: str, spec: OpSpec, values: tuple, frame: Any, claim: bool) -> int:
        pg, tensors, tensor_lists, op, root, group_root, async_op, shape_unless, objects, extra = values
        defs = RecordBatch()
        if tensor_lists:
            tensors = [t for t in tensors if t is not None]
            for lst in tensor_lists:
                tensors.extend(lst or ())
        elif tensors and tensors[0] is None:
            tensors = ()
        if root is None and group_root is not None:
            import torch.distributed as dist
            root = dist.get_global_rank(pg if pg is not None else dist.group.WORLD, group_root)
        if spec.p2p:
            src, dst = (self.rank, root) if spec.p2p == "send" else (root, self.rank)
            group = f"p2p:{'any' if src is None else src}>{dst}"
            self._gid(group, (src, dst), defs)
            seq = self._seq.get(group, 0) + 1
            if claim:
                self._claim_p2p_number(pg, defs)
            local_seq = seq
        else:
            entry = self._group(pg, defs)
            group, seq = self._number(name, entry, defs, extra)
            local_seq = seq - entry.skew if group == entry.key else seq
        if op is not None:
            reduce_op = op
            try:
                op = self._op_names[op]
            except (KeyError, TypeError):
                op = self._op_name(op)
            if len(self._op_ids) < MAX_FAST_OPS:   # a ReduceOp made per call (premul_sum) would pile up
                self._op_ids[id(reduce_op)] = (reduce_op, op)
        elif spec.reduce_op:
            op = "SUM"
        described = tuple([(t.shape, t.dtype, t.device) for t in tensors])
        if objects is not None:   # the list's length must agree (a sender with 2 objects, receivers with 1)
            described = (((len(objects),), "object", None),)
        is_async = name in ASYNC_BY_NATURE or bool(async_op)
        splits, members = extra_fields(name, extra, pg if pg is not None else self._default_group())
        # Uneven all_to_all lists differ in shape on purpose: the splits say what must agree.
        skip_shapes = (spec.shape_unless is not None and shape_unless is not None) or (splits is not None and tensor_lists)
        fp_key = (name, op, root, is_async, skip_shapes, described, self.resolver.key(frame), splits, members)
        fp = self._fps.get(fp_key)
        if fp is None:
            fp = self._define(fp_key, defs)
        self._local.last_fp = fp
        self._seq[group] = seq
        self.count += 1
        self.slow_calls += 1
        gid = self._gids[group]
        # definitions go in the same write as, and before, their first use
        defs.add(enter_slot(gid, fp >> FP_SHIFT, local_seq, time_ns()))
        self.writer.write(defs.data())
        return gid << SEQ_BITS | local_seq

    def _op_name(self, op: Any) -> str:
        text = reduce_op_name(op)
        try:
            self._op_names[op] = text
        except TypeError:   # an unhashable ReduceOp (e.g. premul_sum): name it every time
            pass
        return text

    def _define(self, fp_key: tuple, defs: RecordBatch) -> int:
        name, op, root, is_async, skip_shapes, described, site_key, splits, members = fp_key
        site = self._sites.get(site_key)
        if site is None:
            site = self._sites[site_key] = str(len(self._sites))
            defs.define(site_record(site, *self.resolver.describe(site_key)))
        shapes = NONE if skip_shapes else encode_shapes(tuple(tuple(s) for s, _, _ in described))
        dtypes = ";".join(str(d).removeprefix("torch.") for _, d, _ in described) or NONE
        device = described[0][2].type if described and described[0][2] is not None else NONE
        fp = len(self._fps)
        defs.define(fingerprint_record(fp, name, op, shapes, dtypes, device, root, is_async, site, splits, members))
        self._fps[fp_key] = fp << FP_SHIFT | TAG_E
        return self._fps[fp_key]

    def _enter_p2p_op(self, p2p: Any, frame: Any) -> int:
        op_name = getattr(p2p.op, "__name__", str(p2p.op))
        spec = OPS.get(op_name, OPS["isend"])
        # (group, tensors, tensor_lists, reduce_op, root, group_root, async_op, shape_unless)
        values = (p2p.group, (p2p.tensor,), (), None, p2p.peer, None, None, None, None, None)
        return self._enter(op_name, spec, values, frame, claim=False)   # a batch is numbered as a whole

    def _exit_guarded(self, key: int, exc: BaseException | None) -> None:
        """``_exit``, its own failure counted (rule 0): never raised instead of the user's exception."""
        try:
            self._exit(key, exc)
        except Exception as err:
            failed(Hook.TRACER, err)

    def _exit(self, key: int, exc: BaseException | None) -> None:
        if exc is None:
            self.writer.write(exit_slot(key, time_ns()))
            return
        self._error_ids += 1   # 0 is "no error"
        self.writer.write(text_slots(error_record(self._error_ids, exc)) + exit_slot(key, time_ns(),
                                                                                      self._error_ids))


def _in_forked_child(tracer: Callable[[], Tracer | None]) -> None:
    """``os.register_at_fork``'s hook in a forked child (rule 0: a failure is counted, never printed there)."""
    try:
        t = tracer()
        if t is not None:
            t._after_fork()
    except Exception as exc:
        failed(Hook.TRACER, exc)


def install(path: Any, rank: int) -> Tracer:
    tracer = Tracer(path, rank)
    tracer.install()
    return tracer
