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

import bisect
import functools
import inspect
import os
import sys
import threading
import weakref
from collections import deque
from time import time_ns
from typing import Any, Callable

from distcheck.files.trace import (CHECK, FP_SHIFT, NONE, SEQ_BITS, SLOT_STRUCT, TAG_E, X_OK, RecordBatch, clean,
                                   encode_shapes, enter_slot, error_record, exit_slot, fingerprint_record,
                                   group_record, segment_record, site_record, text_slots, wait_slots)
from distcheck.files.trace_writer import TraceWriter
from distcheck.rank.callsite import CallsiteResolver
from distcheck.rank.guard import Hook, failed
from distcheck.rank.groups import c10d_default_group, c10d_group, counter_of, group_counters, members_of
from distcheck.knowledge.library_shapes import NUMBERED_APART
from distcheck.rank.ops import (ASYNC_BY_NATURE, MULTI_SEQ, OPS, UNCOUNTED, WAITED_HANDLES, OpSpec, extra_fields,
                                make_extractor, new_group_sequence, reduce_op_name)


# Reduce op objects the fast path knows by identity; others (one made per call) take the slow path.
MAX_FAST_OPS = 64


class _Local(threading.local):
    active = False          # inside a traced call on this thread
    last_fp = 0             # the fingerprint this thread's last slow-path call wrote


class Tracer:
    """Records collectives of one rank into its trace file.

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
        self.writer = TraceWriter(Path(path))
        self.resolver = CallsiteResolver()
        self._resolve_group = group_resolver or c10d_group
        self._default_group = default_group or c10d_default_group()
        # group -> the newest number this tracer wrote (the group's own counter where it has one)
        self._seq: dict[str, int] = {}
        # id(pg) -> (key, pg, group id, the group's collective counter or None, its value at the
        # segment's start, the numbers written for it not yet taken by the sidecar, group id << SEQ_BITS
        # (a call key is that + seq), group id << 8 (its part of an E record's first word), [the numbers
        # calls outside the collective numbering took so far]); pg kept alive so its id stays valid
        self._groups: dict[int, tuple[str, Any, int, Callable[[], int] | None, int, deque, int, int, list]] = {}
        self._gids: dict[str, int] = {}     # group (or p2p pair) -> its id in the trace
        self._written: dict[str, deque] = {}
        # Numbers count from each group's counter when tracing started (0 for groups made later).
        self._bases: dict[str, int] = {key: counter() for key, counter in group_counters()}
        self._multi: tuple[str, Callable[[], int], int] | None = None
        # group -> counter numbers taken by calls outside the collective numbering (P2P, gloo's
        # monitored_barrier: distcheck.knowledge.library_shapes), as ([from offset, ...], [skew from there, ...])
        self._skews: dict[str, tuple[list[int], list[int]]] = {}
        # Shared with the sidecar that finds C++-issued calls (rank.native): the group a Python call
        # is in right now (its numbers are its own), and a lock held while a new segment starts.
        self.busy_group: str | None = None
        self.lock = threading.Lock()
        self.segment_listeners: list[Any] = []   # end_segment() before the B record, reset() after
        self._sites: dict[tuple, str] = {}
        self._fps: dict[tuple, int] = {}   # fingerprint -> its id << FP_SHIFT | TAG_E
        self._error_ids = 0
        self._op_names: dict[Any, str] = {}
        self._op_ids: dict[int, tuple[Any, str]] = {}   # id(reduce op) -> (the op, kept alive; its name)
        self._fast: dict[str, dict[tuple, int]] = {}    # op -> the fast path's key -> fingerprint
        # Held while a call takes the slow path: an id is registered, then written, and no other thread may
        # use it in between (a record naming a group not defined yet cannot be read).
        self._defining = threading.Lock()
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=functools.partial(_in_forked_child, me))
        self._local = _Local()
        self._originals: dict[str, Callable] = {}
        # id(work) -> (a weak reference to it, the call keys it completes): the handles of P2P calls, whose
        # ``wait()`` is written as W records (the rank is blocked in those calls while it waits)
        self._handles: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}
        self._work_wait: tuple[Any, Callable] | None = None   # (torch's Work class, its own wait)
        self.count = 0
        self.slow_calls = 0   # calls that took ``_enter`` (first of their kind, p2p, lists...): a cost to watch

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
            self.writer.write(segment_record(name))
            for listener in self.segment_listeners:
                listener.reset()

    def take_written(self, group: str) -> list[int]:
        """The numbers written for ``group`` since the last call (the sidecar's; thread-safe)."""
        written = self._written.get(group)
        out = []
        while written:
            out.append(written.popleft())
        return out

    def trace_seq(self, group: str, offset: int) -> int:
        """The trace's number for the group counter's ``offset`` (counter minus ``seq_base``): less the
        numbers that P2P calls and gloo's monitored_barrier took before it, which a rank's peers do not
        count alike (``distcheck.knowledge.library_shapes``). Thread-safe (the sidecar's)."""
        skews = self._skews.get(group)
        if not skews:
            return offset
        i = bisect.bisect_right(skews[0], offset)
        return offset - (skews[1][i - 1] if i else 0)

    def _skew_after(self, entry: tuple, before: int, width: int) -> None:
        """A call numbered apart has returned: the counter numbers it took beyond ``width`` are not
        the collective numbering's, so later calls' numbers stay aligned with their peers'."""
        try:
            taken = entry[3]() - before
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if taken == width:
            return
        current = entry[8]
        current[0] += taken - width
        offsets, skews = self._skews.setdefault(entry[0], ([], []))
        offsets.append(before - entry[4] + taken + 1)
        skews.append(current[0])

    def seq_base(self, group: str) -> int:
        """The group's counter when this segment started (numbers in the trace count from it)."""
        return self._bases.get(group, 0)

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
            self._work_wait = (work, original)
            work.wait = self._wrap_wait(original)

    def uninstall(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()
        if self._work_wait is not None:
            work, original = self._work_wait
            work.wait = original
            self._work_wait = None

    def close(self) -> None:
        self.writer.close()

    # -- wrapping -----------------------------------------------------------

    def wrap(self, name: str, original: Callable, spec: OpSpec | None = None,
             signature_of: Callable | None = None) -> Callable:
        """``original`` traced as collective ``name`` (the code path ``install`` uses).

        ``signature_of``: read argument positions from this function instead
        (a stand-in collective with the real one's signature).
        """
        spec = spec or OPS[name]
        extract = make_extractor(name, spec, list(inspect.signature(signature_of or original).parameters.values()))
        local = self._local
        enter = self._make_enter(name, spec)
        writer = self.writer
        append = writer.append
        pack = SLOT_STRUCT.pack
        exit_check = X_OK ^ CHECK
        getframe = sys._getframe
        multi = name in MULTI_SEQ
        apart = NUMBERED_APART.get(name)   # P2P, gloo's monitored_barrier: how many numbers it takes
        waited = name in WAITED_HANDLES    # isend, irecv: their handle's wait() is where the rank blocks
        p2p = spec.p2p is not None
        tracer = self

        # Rule 0 (rank.guard): an error of distcheck's own below is caught and counted, never raised into
        # the user's call, which returns its own result or raises its own exception unchanged. (A try costs
        # nothing in CPython 3.11 until something raises.)
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
                        if waited:
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
                        tracer._skew_after(mark[0], mark[1], apart)
                        if p2p:
                            tracer._claim_rest(mark[0], mark[1])
                    tracer.busy_group = None   # after the numbers: the sidecar reads it first
                except Exception as exc:
                    failed(Hook.TRACER, exc)
                local.active = False

        traced.__distcheck_original__ = original  # type: ignore[attr-defined]
        return traced

    def _claim_rest(self, entry: tuple, before: int) -> None:
        """After a P2P call: the counter numbers it took past the one claimed when it started (send_object_list and
        recv_object_list send the size, then the data) are a Python call's too, not C++-issued collectives."""
        try:
            after = entry[3]()
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if after > before + 1:
            entry[5].extend(range(before - entry[4] + 2, after - entry[4] + 1))

    def _mark(self, pg: Any) -> tuple[tuple, int] | None:
        """(the group's entry, its counter now) before a call numbered apart starts."""
        try:
            entry = self._groups.get(id(pg if pg is not None else self._default_group()))
            return None if entry is None or entry[3] is None else (entry, entry[3]())
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return None

    def _resync(self) -> None:
        """After a call that ran several collectives: its numbers up to the counter are its own."""
        if self._multi is not None:
            group, counter, base = self._multi
            self._multi = None
            try:
                last = counter() - base
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                return
            written = self._written.setdefault(group, deque())
            written.extend(range(self._seq.get(group, 0) + 1, last + 1))
            self._seq[group] = max(self._seq.get(group, 0), last)

    def _wrap_batch(self, original: Callable) -> Callable:
        local = self._local

        @functools.wraps(original)
        def traced(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
            if local.active:
                return original(p2p_op_list, *args, **kwargs)
            local.active = True
            claims: list[tuple[tuple, int]] = []
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
                local.active = False

        traced.__distcheck_original__ = original  # type: ignore[attr-defined]
        return traced

    def _hold(self, works: Any, keys: list[int] | tuple[int, ...]) -> None:
        """Remember the handles a P2P call returned, so a ``wait()`` on one is written as a wait in its calls:
        one handle per call (gloo's batch), or handles that each complete the whole batch (a coalesced one)."""
        works = [w for w in (works or ()) if w is not None]
        if not works or not keys:
            return
        keys = tuple(keys)
        per_call = len(works) == len(keys)
        handles = self._handles
        for i, work in enumerate(works):
            wid = id(work)
            ref = weakref.ref(work, lambda _, wid=wid: handles.pop(wid, None))
            handles[wid] = (ref, keys[i:i + 1] if per_call else keys)

    def _wrap_wait(self, original: Callable) -> Callable:
        """torch's ``Work.wait``, which writes W records around the wait on a P2P call's handle (any other
        handle's wait is torch's own, untouched)."""
        handles = self._handles
        writer = self.writer

        def record(keys: tuple[int, ...], out: bool) -> None:
            data = wait_slots(keys, time_ns(), out)
            try:
                writer.append(data)
            except ValueError:    # the mapping is full: grow it
                writer.write(data)

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            held = handles.get(id(work))
            if held is None:
                return original(work, *args, **kwargs)
            keys = None
            try:   # rule 0, as in wrap()
                if held[0]() is work:
                    keys = held[1]
                    record(keys, False)
            except Exception as exc:
                failed(Hook.TRACER, exc)
            result = original(work, *args, **kwargs)
            # Only a wait that returned ends the rank's wait in the record. One that raised is, nearly always, a
            # peer that died or was ended while this rank waited (distcheck's teardown after a hang): the rank
            # was stuck in that call, and its record must say so, not that the wait completed.
            if keys is not None:
                try:
                    record(keys, True)
                except Exception as exc:
                    failed(Hook.TRACER, exc)
            return result

        wait.__distcheck_original__ = original  # type: ignore[attr-defined]
        return wait

    def _batch_counters(self, p2p_op_list: list) -> list[tuple[tuple, int]]:
        """(group entry, its counter now) for each group a batch of P2P ops runs on, the group marked busy.

        A batch advances its groups' collective counters by a number the backend decides (gloo: one per
        op), and the sidecar must not take those numbers for C++-issued collectives."""
        claims = []
        defs = RecordBatch()
        with self._defining:
            for pg in {id(p.group): p.group for p in p2p_op_list}.values():
                try:
                    entry = self._group(pg, defs)
                    if entry[3] is not None:
                        claims.append((entry, entry[3]()))
                        self.busy_group = entry[0]
                except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                    failed(Hook.NUMBERING, exc)
                    continue
            if defs:
                self.writer.write(defs.data())
        return claims

    def _claim_batch(self, claims: list[tuple[tuple, int]]) -> None:
        """After the batch: every number its groups counted meanwhile is the batch's (written by Python)."""
        for entry, before in claims:
            try:
                after = entry[3]()
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                continue
            entry[5].extend(range(before - entry[4] + 1, after - entry[4] + 1))
            self._skew_after(entry, before, 0)   # a batch is P2P: none of its numbers are collectives'
        self.busy_group = None   # after the numbers: the sidecar reads it first

    # -- records ------------------------------------------------------------

    def _make_enter(self, name: str, spec: OpSpec) -> Callable[[tuple, Any], int]:
        """The enter step for one op: a fast path for a call like one seen before
        (known group and fingerprint: one dict lookup, one slot), and ``_enter``
        for everything else (first calls, p2p, tensor lists, group ranks).

        The fast path keeps its own cache, keyed by a flat tuple of what the call
        shows (cheaper to build and hash than ``_enter``'s fingerprint key): a key
        not seen yet takes ``_enter``, and the fingerprint it wrote is cached under it.
        """
        slow = functools.partial(self._enter, name, spec)
        if (spec.p2p or spec.tensor_lists or len(spec.tensors) > 1 or name in MULTI_SEQ or name in UNCOUNTED
                or spec.extra):
            return slow
        groups, seqs, op_ids, local = self._groups, self._seq, self._op_ids, self._local
        fast = self._fast.setdefault(name, {})
        site_key = self.resolver.key
        default_group = self._default_group
        writer = self.writer
        append = writer.append
        pack = SLOT_STRUCT.pack
        tracer = self

        def learn(values: tuple, frame: Any) -> int:
            """A reduce op not seen yet: ``_enter`` names it, then the call is cached like any other."""
            key = slow(values, frame)
            named = op_ids.get(id(values[3]))
            if named is not None:
                _, tensors, _, _, root, _, async_op, shape_unless, _, _ = values
                fast[_seen(site_key(frame), named[1], root, async_op, shape_unless, tensors)] = local.last_fp
            return key

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
            if fp is None or entry is None or (pg is not None and entry[1] is not pg):
                key = slow(values, frame)
                fast[seen] = local.last_fp
                return key
            group, counter = entry[0], entry[3]
            seq = (seqs[group] if counter is None else counter() - entry[4]) + 1
            seqs[group] = seq
            entry[5].append(seq)
            tracer.busy_group = group
            tracer.count += 1
            key = entry[6] + seq - entry[8][0]
            w0 = fp | entry[7]
            t = time_ns()
            record = pack(w0, key, t, w0 ^ key ^ t ^ CHECK)
            try:
                append(record)
            except ValueError:    # the mapping is full: grow it
                writer.write(record)
            return key

        return enter

    def _group(self, pg: Any, out: RecordBatch) -> tuple:
        """The group's entry (key, pg, id, counter, base, ...), defined on first use."""
        if pg is None:
            pg = self._default_group()
            if pg is None:
                raise RuntimeError("no default process group")   # the call itself will say so
        entry = self._groups.get(id(pg))
        if entry is not None and entry[1] is pg:
            return entry
        key, ranks = self._resolve_group(pg)
        key = clean(key or str(len(self._groups)))
        written = self._written.setdefault(key, deque())
        gid = self._gid(key, ranks, out)
        skews = self._skews.get(key)
        entry = self._groups[id(pg)] = (key, pg, gid, counter_of(pg), self._bases.get(key, 0), written,
                                        gid << SEQ_BITS, gid << 8, [skews[1][-1] if skews else 0])
        self._seq.setdefault(key, 0)
        return entry

    def _gid(self, key: str, ranks: Any, out: RecordBatch) -> int:
        """The trace's id for a group (or p2p pair), defined on first use."""
        gid = self._gids.get(key)
        if gid is None:
            gid = self._gids[key] = len(self._gids)
            out.define(group_record(gid, key, ranks))
        return gid

    def _number(self, name: str, entry: tuple, out: RecordBatch, extra: tuple | None = None) -> tuple[str, int]:
        """(group, seq) for a call on a group: the group's own counter + 1, where it has one."""
        key, _, _, counter, base, written, _, _, _ = entry
        if name in UNCOUNTED:   # new_group: its own sequence (ops.new_group_sequence)
            key, ranks = new_group_sequence(extra, self.rank, members_of(entry[1]))
            self._gid(key, ranks, out)
            counter = None
        seq = (self._seq.get(key, 0) if counter is None else counter() - base) + 1
        if counter is not None:
            written.append(seq)
            self.busy_group = key
        if name in MULTI_SEQ and counter is not None:
            self._multi = (key, counter, base)
        return key, seq

    def _claim_p2p_number(self, pg: Any, defs: RecordBatch) -> None:
        """A send/recv advances its group's collective counter by one (gloo): tell the sidecar that
        number is a Python call's, or it would record it as an unknown C++-issued collective."""
        try:
            entry = self._group(pg, defs)
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if entry[3] is not None:
            entry[5].append(entry[3]() - entry[4] + 1)
            self.busy_group = entry[0]

    def _after_fork(self) -> None:
        self._defining = threading.Lock()   # another thread of the parent may have held it

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
            local_seq = seq - entry[8][0] if group == entry[0] else seq
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


def _seen(site: tuple, op: str | None, root: Any, async_op: Any, shape_unless: Any, tensors: tuple) -> tuple:
    """The fast path's key for a call: what it shows, flat (cheaper to build and hash than a fingerprint)."""
    t = tensors[0] if tensors else None
    return ((site, op, root, async_op, shape_unless is None) if t is None else
            (site, op, root, async_op, shape_unless is None, t.shape, t.dtype, t.device))


def install(path: Any, rank: int) -> Tracer:
    tracer = Tracer(path, rank)
    tracer.install()
    return tracer
