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
from collections.abc import Callable
from time import time_ns
from typing import Any, NamedTuple

from distcheck.files.trace import (FP_SHIFT, NONE, TAG_E, RecordBatch, call_key, encode_shapes, enter_slot,
                                   error_record, exit_slot, fingerprint_record, segment_record, site_record, text_slots)
from distcheck.files.trace_writer import TraceWriter
from distcheck.rank.callsite import CallsiteResolver
from distcheck.rank.completion import Completion
from distcheck.rank.groups import c10d_default_group, c10d_group
from distcheck.rank.guard import Hook, failed
from distcheck.rank.handles import Handles
from distcheck.rank.hot_path import (HotPathState, KnownOp, LastWritten, c_hot_path, hot_state, thread_flag,
                                     traced_call)
from distcheck.rank.numbering import Mark, Numbering
from distcheck.rank.patches import Patches
from distcheck.rank.ops import ASYNC_BY_NATURE, OPS, CallArgs, OpSpec, extra_fields, reduce_op_name


# Reduce op objects the fast path knows by identity; others (one made per call) take the slow path.
MAX_FAST_OPS = 64


class FingerprintKey(NamedTuple):
    """Everything a call's ``F`` record says, as the slow path finds it: one ``F`` record per distinct key."""

    name: str
    op: str | None
    root: int | None
    is_async: bool
    skip_shapes: bool | tuple[Any, ...]   # truthy: the shapes are not compared (a call's tensor lists, as given)
    described: tuple            # (shape, dtype, device) of each tensor; ((n,), "object", None) for an object list
    site_key: tuple             # ``CallsiteResolver.key``
    splits: tuple | None
    members: tuple[int, ...] | None


class Tracer:
    """Records collectives of one rank into its trace file: what is installed and the slow path here; its parts,
    each with its own state: the hot path's (``hot_path``: ``rank.hot_path.HotPathState``), the numbering
    (``numbering``: ``rank.numbering``), the P2P handles (``handles``: ``rank.handles``).

    ``group_resolver(pg) -> (key, ranks)`` names a process group and
    ``default_group()`` returns the group a call without ``group=`` uses; both
    ask ``distributed_c10d`` unless given (benchmarks and tests pass their own
    to trace without a process group).
    """

    def __init__(self, path: Any, rank: int,
                 group_resolver: Callable[[Any], tuple[str | None, tuple[int, ...]]] | None = None,
                 default_group: Callable[[], Any] | None = None, completion: Completion | None = None) -> None:
        from pathlib import Path

        self.rank = rank
        self.completion = completion or Completion()   # when a call's work completed (NCCL): shared with the sidecar
        self.c_path = c_hot_path()   # the hot path in C, or None (the Python wrapper): one choice for every wrapper
        self.writer = TraceWriter(Path(path), cursor_type=self.c_path.SlotCursor if self.c_path is not None else None)
        self.resolver = CallsiteResolver()
        # Shared with the sidecar that finds C++-issued calls (rank.native): the group a Python call is in right
        # now (``busy_group``: its numbers are its own), and a lock held while a new segment starts.
        self.hot = hot_state(self.c_path)   # busy_group and count, set by every recorded call
        self.lock = threading.Lock()
        self.segment_listeners: list[Any] = []   # end_segment() before the B record, reset() after
        fast_calls: weakref.WeakSet = weakref.WeakSet()   # the C hot path's wrappers (rank.hot_path)
        self.numbering = Numbering(rank, group_resolver or c10d_group, default_group or c10d_default_group(),
                                   self.completion, self.hot, on_skew=functools.partial(_forget_last_calls, fast_calls))
        self.handles = Handles(self.writer)
        # the fingerprints written: their sites, keys, reduce ops' names, the C path's keys (rank.hot_path)
        self._sites: dict[tuple, str] = {}
        self._fps: dict[FingerprintKey, int] = {}   # -> its id << FP_SHIFT | TAG_E
        self._op_names: dict[Any, str] = {}
        self._error_ids = 0
        self.hot_path = HotPathState(
            c_path=self.c_path, inside=thread_flag(self.c_path), hot=self.hot, writer=self.writer,
            numbering=self.numbering, handles=self.handles, enter=self.enter, exit_guarded=self.exit_guarded,
            failed=functools.partial(failed, Hook.TRACER), fast={}, op_ids={}, last_written=LastWritten(),
            plain_user=self.resolver.plain_user, site_key=self.resolver.key, fast_calls=fast_calls)
        # Held while a call takes the slow path: an id is registered, then written, and no other thread may
        # use it in between (a record naming a group not defined yet cannot be read).
        self._defining = threading.Lock()
        os.register_at_fork(after_in_child=functools.partial(_in_forked_child, weakref.ref(self)))
        self._originals: dict[str, Callable] = {}
        self._patches = Patches()   # the attributes install replaced
        self.slow_calls = 0   # calls that took ``enter`` (first of their kind, p2p, lists...): a cost to watch

    @property
    def busy_group(self) -> str | None:
        """The group a Python call is in right now (its numbers are its own), or None."""
        return self.hot.busy_group

    @property
    def count(self) -> int:
        """Calls recorded."""
        return self.hot.count

    # -- what the sidecar reads (rank.native.TracerSide) ---------------------

    def take_written(self, group: str) -> list[int]:
        return self.numbering.take_written(group)

    def trace_seq(self, group: str, offset: int) -> int:
        return self.numbering.trace_seq(group, offset)

    def seq_base(self, group: str) -> int:
        return self.numbering.seq_base(group)

    def handles_on_device(self) -> bool:
        return self.handles.handles_on_device()

    def completed_on_device(self) -> list[int]:
        return self.handles.completed_on_device()

    def begin_segment(self, name: str) -> None:
        """Start a self-contained part of the trace (the next scenario of a batched launch).

        Sequence numbers restart (counted from each group's counter now) and every
        definition is written again after the ``B`` record, so each part parses on
        its own (``distcheck.files.trace_reader.split_segments``).
        """
        with self.lock:
            for listener in self.segment_listeners:
                listener.end_segment()
            self.numbering.begin_segment()
            self.handles.begin_segment()   # their keys name the finished segment's calls
            self._sites.clear()
            self._fps.clear()
            for cache in self.hot_path.fast.values():
                cache.clear()
            _forget_last_calls(self.hot_path.fast_calls)   # they name cleared keys and groups
            self.writer.write(segment_record(name))
            for listener in self.segment_listeners:
                listener.reset()

    # -- installation -------------------------------------------------------

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrappers = {name: self.wrap(name, getattr(c10d, name), spec) for name, spec in OPS.items()
                    if getattr(c10d, name, None) is not None}
        if getattr(c10d, "batch_isend_irecv", None) is not None:
            wrappers["batch_isend_irecv"] = self._wrap_batch(c10d.batch_isend_irecv)
        for name, wrapper in wrappers.items():
            original = getattr(c10d, name)
            self._originals[name] = original
            self._patches.set(c10d, name, wrapper)
            if getattr(dist, name, None) is original:   # torch.distributed re-exports it
                self._patches.set(dist, name, wrapper)
        work = getattr(c10d, "Work", None)
        original = getattr(work, "wait", None)
        if original is not None:
            self.handles.install_wait(work, original)

    def uninstall(self) -> None:
        self._patches.undo()   # exactly what install replaced, nothing it did not
        self._originals.clear()
        self.handles.uninstall_wait()

    def close(self) -> None:
        self.writer.close()

    # -- wrapping -----------------------------------------------------------

    def wrap(self, name: str, original: Callable, spec: OpSpec | None = None,
             signature_of: Callable | None = None) -> Callable:
        """``original`` traced as collective ``name`` (the code path ``install`` uses); ``signature_of``: read
        argument positions from this function instead (a stand-in collective with the real one's signature)."""
        return traced_call(self.hot_path, name, original, spec, signature_of)

    def _wrap_batch(self, original: Callable) -> Callable:
        inside, numbering, handles = self.hot_path.inside, self.numbering, self.handles

        @functools.wraps(original)
        def traced(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
            if inside.active:
                return original(p2p_op_list, *args, **kwargs)
            inside.active = True
            marks: list[Mark] = []
            keys: list[int] = []
            try:
                try:   # rule 0, as in the traced call (rank.hot_path)
                    frame = sys._getframe(1)
                    for p2p in p2p_op_list:
                        keys.append(self._enter_p2p_op(p2p, frame))
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                try:   # unrecorded or not, the batch's numbers are not C++-issued collectives
                    marks = self._batch_marks(p2p_op_list)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                try:
                    result = original(p2p_op_list, *args, **kwargs)
                except BaseException as exc:
                    for key in keys:
                        self.exit_guarded(key, exc)
                    raise   # the user's exception, as it was
                for key in keys:
                    self.exit_guarded(key, None)
                try:
                    handles.hold(result, keys)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                return result
            finally:
                try:
                    numbering.claim_batch(marks)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                inside.active = False

        traced.__distcheck_original__ = original  # type: ignore[attr-defined]
        return traced

    def _batch_marks(self, p2p_op_list: list) -> list[Mark]:
        """``Numbering.batch_marks``, the groups it defines written."""
        with self._defining:
            defs = RecordBatch()
            marks = self.numbering.batch_marks(p2p_op_list, defs)
            if defs:
                self.writer.write(defs.data())
        return marks

    # -- records ------------------------------------------------------------

    def _after_fork(self) -> None:
        self._defining = threading.Lock()   # another thread of the parent may have held it
        self.handles.after_fork()

    def enter(self, name: str, spec: OpSpec, args: CallArgs, frame: Any, claim: bool = True) -> int:
        """The slow path: write the enter record and its new definitions; return the call key its exit record
        repeats. The fingerprint it wrote is left in ``hot_path.last_written`` (the C path files it)."""
        with self._defining:
            defs = RecordBatch()
            try:
                return self._enter_defining(name, spec, args, frame, claim, defs)
            except BaseException:
                # a call that could not be recorded: the ids it registered on the way are still defined in the
                # file, or a later record that names them could not be read
                if defs:
                    self.writer.write(defs.data())
                raise

    def _enter_defining(self, name: str, spec: OpSpec, args: CallArgs, frame: Any, claim: bool,
                        defs: RecordBatch) -> int:
        tensors = _tensors(args)
        pg, root = args.group, args.root
        if root is None and args.group_root is not None:
            import torch.distributed as dist
            root = dist.get_global_rank(pg if pg is not None else dist.group.WORLD, args.group_root)
        if spec.p2p:
            src, dst = (self.rank, root) if spec.p2p == "send" else (root, self.rank)
            numbered = self.numbering.number_p2p(pg, src, dst, claim, defs)
            if numbered.on_device:   # NCCL: its handle says when it completed
                self.handles.on_device(numbered.gid)
        else:
            numbered = self.numbering.number(name, pg, defs, args.extra)
        fp_key = self._fingerprint_key(name, spec, args, tensors, root, frame)
        fp = self._fps.get(fp_key)
        if fp is None:
            fp = self._define(fp_key, defs)
        self.hot_path.last_written.fp = fp
        self.numbering.commit(numbered)
        self.hot.count += 1
        self.slow_calls += 1
        # definitions go in the same write as, and before, their first use
        defs.add(enter_slot(numbered.gid, fp >> FP_SHIFT, numbered.local_seq, time_ns()))
        self.writer.write(defs.data())
        return call_key(numbered.gid, numbered.local_seq)

    def _fingerprint_key(self, name: str, spec: OpSpec, args: CallArgs, tensors: Any, root: Any,
                         frame: Any) -> FingerprintKey:
        """What the call's ``F`` record says (its reduce op, once named, known to the C path by identity)."""
        op = args.reduce_op
        if op is not None:
            try:
                op = self._op_names[op]
            except (KeyError, TypeError):
                op = self._op_name(op)
            op_ids = self.hot_path.op_ids
            if len(op_ids) < MAX_FAST_OPS:   # a ReduceOp made per call (premul_sum) would pile up
                op_ids[id(args.reduce_op)] = KnownOp(args.reduce_op, op)
        elif spec.reduce_op:
            op = "SUM"
        described = tuple([(t.shape, t.dtype, t.device) for t in tensors])
        if args.object_list is not None:   # the list's length must agree (a sender with 2 objects, receivers with 1)
            described = (((len(args.object_list),), "object", None),)
        is_async = name in ASYNC_BY_NATURE or bool(args.async_op)
        pg = args.group if args.group is not None else self.numbering.default_group()
        splits, members = extra_fields(name, args.extra, pg)
        # Uneven all_to_all lists differ in shape on purpose: the splits say what must agree.
        skip_shapes = ((spec.shape_unless is not None and args.shape_unless is not None)
                       or (splits is not None and args.tensor_lists))
        return FingerprintKey(name, op, root, is_async, skip_shapes, described, self.resolver.key(frame), splits,
                              members)

    def _op_name(self, op: Any) -> str:
        text = reduce_op_name(op)
        try:
            self._op_names[op] = text
        except TypeError:   # an unhashable ReduceOp (e.g. premul_sum): name it every time
            pass
        return text

    def _define(self, key: FingerprintKey, defs: RecordBatch) -> int:
        site = self._sites.get(key.site_key)
        if site is None:
            site = self._sites[key.site_key] = str(len(self._sites))
            defs.define(site_record(site, *self.resolver.describe(key.site_key)))
        described = key.described
        shapes = NONE if key.skip_shapes else encode_shapes(tuple(tuple(shape) for shape, _, _ in described))
        dtypes = ";".join(str(dtype).removeprefix("torch.") for _, dtype, _ in described) or NONE
        first_device = described[0][2] if described else None
        device = first_device.type if first_device is not None else NONE
        fp = len(self._fps)
        defs.define(fingerprint_record(fp, key.name, key.op, shapes, dtypes, device, key.root, key.is_async, site,
                                       key.splits, key.members))
        self._fps[key] = fp << FP_SHIFT | TAG_E
        return self._fps[key]

    def _enter_p2p_op(self, p2p: Any, frame: Any) -> int:
        op_name = getattr(p2p.op, "__name__", str(p2p.op))
        spec = OPS.get(op_name, OPS["isend"])
        args = CallArgs(group=p2p.group, tensors=(p2p.tensor,), root=p2p.peer)
        return self.enter(op_name, spec, args, frame, claim=False)   # a batch is numbered as a whole

    def exit_guarded(self, key: int, exc: BaseException | None) -> None:
        """The exit record of call ``key`` (``exc``: the exception it raised), its own failure counted (rule 0):
        never raised instead of the user's exception."""
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


def _tensors(args: CallArgs) -> Any:
    """Every tensor the call names: its tensor parameters' (those given) and its lists' elements."""
    tensors = args.tensors
    if args.tensor_lists:
        listed = [t for t in tensors if t is not None]
        for lst in args.tensor_lists:
            listed.extend(lst or ())
        return listed
    if tensors and tensors[0] is None:
        return ()
    return tensors


def _forget_last_calls(fast_calls: weakref.WeakSet) -> None:
    """The C hot path's wrappers drop the last call each remembers (its key, group and the group's fields)."""
    for call in fast_calls:
        call.forget()


def _in_forked_child(tracer: Callable[[], Tracer | None]) -> None:
    """``os.register_at_fork``'s hook in a forked child (rule 0: a failure is counted, never printed there)."""
    try:
        t = tracer()
        if t is not None:
            t._after_fork()
    except Exception as exc:
        failed(Hook.TRACER, exc)


def install(path: Any, rank: int, completion: Completion | None = None) -> Tracer:
    tracer = Tracer(path, rank, completion=completion)
    tracer.install()
    return tracer
