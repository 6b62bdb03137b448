"""The tracer's numbering: each process group's entry (``GroupEntry``) and the numbers its calls get.

A call on a group is numbered from the group's own collective counter where it has one (so a
C++-issued call between two Python calls leaves its number free for the sidecar, ``rank.native``);
calls the backend numbers apart (P2P, gloo's ``monitored_barrier``: ``knowledge.library_shapes``)
shift the numbering after them so a rank's numbers stay aligned with its peers'. ``Numbering`` is a
part the tracer owns (``Tracer.numbering``): its state is its own, read through its methods, but for
``groups``, ``seqs`` and ``default_group``, which the hot path reads (``rank.hot_path.HotPathState``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from distcheck.files.trace import SEQ_BITS, RecordBatch, clean, group_record
from distcheck.rank.groups import counter_of, group_counters, members_of
from distcheck.rank.guard import Hook, failed
from distcheck.rank.ops import MULTI_SEQ, UNCOUNTED, new_group_sequence
from distcheck.models.group_key import GroupKey


@dataclass(slots=True)
class GroupEntry:
    """A process group as the tracer knows it (kept per ``id(pg)``; ``pg`` is kept alive so its id stays valid)."""

    key: str                            # the group's name in the trace
    pg: Any
    gid: int                            # its id in the trace
    counter: Callable[[], int] | None   # the group's collective counter, where it has one
    base: int                           # the counter's value when this segment started
    written: deque                      # numbers written for it, not yet taken by the sidecar
    key_base: int                       # gid << SEQ_BITS: a call key is this + its number
    e_word: int                         # gid << 8: its part of an E record's first word
    skew: int                           # the numbers calls outside the collective numbering took so far


class Mark(NamedTuple):
    """A group's counter before a call numbered apart starts."""

    entry: GroupEntry
    before: int


class Numbered(NamedTuple):
    """The number a call got: in the trace, ``gid`` and ``local_seq`` (its call key); ``seq``, the group's own."""

    group: str          # the group (or P2P pair, or new_group sequence) it is numbered in
    gid: int
    seq: int            # the newest number of ``group`` once the call is written (``Numbering.commit``)
    local_seq: int      # ``seq`` less the numbers calls outside the collective numbering took before it
    on_device: bool = False   # a P2P call over a device-completed group (NCCL): its handle says when it completed


class Skews(NamedTuple):
    """A group's counter numbers taken by calls outside the collective numbering: from each offset on, the shift."""

    offsets: list[int]
    shifts: list[int]


class Numbering:
    """Each process group's entry and the numbers its calls get (one per tracer, reset per segment).

    ``resolve_group(pg) -> (key, ranks)`` names a group, ``default_group()`` is the group of a call without one;
    ``hot`` is where the group a Python call is busy in is said (``busy_group``: the sidecar reads it), and
    ``on_skew()`` is told when a group's skew moves (the C hot path remembers it with its last call).
    """

    def __init__(self, rank: int, resolve_group: Callable[[Any], tuple[str | None, tuple[int, ...]]],
                 default_group: Callable[[], Any], completion: Any, hot: Any, on_skew: Callable[[], None]) -> None:
        self.rank = rank
        self.default_group = default_group
        self.groups: dict[int, GroupEntry] = {}   # id(pg) -> its entry (the C hot path looks groups up here)
        # group -> the newest number written (the group's own counter where it has one; the C hot path numbers a
        # group without one here)
        self.seqs: dict[str, int] = {}
        self._resolve_group, self._completion, self._hot, self._on_skew = resolve_group, completion, hot, on_skew
        self._gids: dict[str, int] = {}     # group (or p2p pair) -> its id in the trace
        self._written: dict[str, deque] = {}
        self._multi: GroupEntry | None = None   # the group of a MULTI_SEQ call in flight (counted in full after it)
        # group -> counter numbers taken by calls outside the collective numbering (P2P, gloo's
        # monitored_barrier: distcheck.knowledge.library_shapes)
        self._skews: dict[str, Skews] = {}
        # Numbers count from each group's counter when tracing started (0 for groups made later).
        self._bases: dict[str, int] = {key: counter() for key, counter in group_counters()}

    def begin_segment(self) -> None:
        """Numbers restart (counted from each group's counter now) and every group is defined again."""
        self._bases = {key: counter() for key, counter in group_counters()}
        for state in (self.seqs, self._skews, self.groups, self._gids, self._written):
            state.clear()   # cleared, never replaced: the hot path holds them

    # -- the sidecar's (thread-safe) ----------------------------------------

    def take_written(self, group: str) -> list[int]:
        """The numbers written for ``group`` since the last call."""
        written = self._written.get(group)
        out = []
        while written:
            out.append(written.popleft())
        return out

    def trace_seq(self, group: str, offset: int) -> int:
        """The trace's number for the group counter's ``offset`` (counter minus ``seq_base``): less the
        numbers that P2P calls and gloo's monitored_barrier took before it, which a rank's peers do not
        count alike (``distcheck.knowledge.library_shapes``)."""
        skews = self._skews.get(group)
        if not skews:
            return offset
        i = bisect.bisect_right(skews.offsets, offset)
        return offset - (skews.shifts[i - 1] if i else 0)

    def seq_base(self, group: str) -> int:
        """The group's counter when this segment started (numbers in the trace count from it)."""
        return self._bases.get(group, 0)

    # -- a call's number ----------------------------------------------------

    def number(self, name: str, pg: Any, out: RecordBatch, extra: tuple | None = None) -> Numbered:
        """The number of a call on a group: the group's own counter + 1, where it has one."""
        entry = self.group(pg, out)
        key, counter, base, written = entry.key, entry.counter, entry.base, entry.written
        if name in UNCOUNTED:   # new_group: its own sequence (ops.new_group_sequence)
            key, ranks = new_group_sequence(extra, self.rank, members_of(entry.pg))
            self._gid(key, ranks, out)
            counter = None
        seq = (self.seqs.get(key, 0) if counter is None else counter() - base) + 1
        if counter is not None:
            written.append(seq)
            self._hot.busy_group = key
        if name in MULTI_SEQ and counter is not None:
            self._multi = entry
        return Numbered(key, self._gids[key], seq, seq - entry.skew if key == entry.key else seq)

    def number_p2p(self, pg: Any, src: int | None, dst: int | None, claim: bool, out: RecordBatch) -> Numbered:
        """The number of a P2P call from ``src`` to ``dst``, in its pair's own sequence; ``claim``: its group's
        counter number is the call's (not a batch's, which is numbered as a whole)."""
        group = str(GroupKey.p2p(src, dst))   # a plain str: the hot path keys exact strings
        gid = self._gid(group, (src, dst), out)
        seq = self.seqs.get(group, 0) + 1
        if claim:
            self._claim_p2p_number(pg, out)
        return Numbered(group, gid, seq, seq, bool(self._completion.device(self.group(pg, out).key)))

    def commit(self, numbered: Numbered) -> None:
        """The call is written: its number is its group's newest."""
        self.seqs[numbered.group] = numbered.seq

    def group(self, pg: Any, out: RecordBatch) -> GroupEntry:
        """The group's entry, defined on first use."""
        if pg is None:
            pg = self.default_group()
            if pg is None:
                raise RuntimeError("no default process group")   # the call itself will say so
        entry = self.groups.get(id(pg))
        if entry is not None and entry.pg is pg:
            return entry
        key, ranks = self._resolve_group(pg)
        key = clean(key or str(len(self.groups)))
        written = self._written.setdefault(key, deque())
        gid = self._gid(key, ranks, out, device=self._completion.attach(pg, key))
        skews = self._skews.get(key)
        entry = self.groups[id(pg)] = GroupEntry(key, pg, gid, counter_of(pg), self._bases.get(key, 0), written,
                                                 gid << SEQ_BITS, gid << 8, skews.shifts[-1] if skews else 0)
        self.seqs.setdefault(key, 0)
        return entry

    def _gid(self, key: str, ranks: Any, out: RecordBatch, device: bool = False) -> int:
        """The trace's id for a group (or p2p pair), defined on first use; ``device``: its calls complete after
        they return (``rank.completion``)."""
        gid = self._gids.get(key)
        if gid is None:
            gid = self._gids[key] = len(self._gids)
            out.define(group_record(gid, key, ranks, device))
        return gid

    def _claim_p2p_number(self, pg: Any, out: RecordBatch) -> None:
        """A send/recv advances its group's collective counter by one (gloo): tell the sidecar that
        number is a Python call's, or it would record it as an unknown C++-issued collective."""
        try:
            entry = self.group(pg, out)
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if entry.counter is not None:
            entry.written.append(entry.counter() - entry.base + 1)
            self._hot.busy_group = entry.key

    # -- after a call numbered apart ----------------------------------------

    def mark(self, pg: Any) -> Mark | None:
        """(the group's entry, its counter now) before a call numbered apart starts."""
        try:
            entry = self.groups.get(id(pg if pg is not None else self.default_group()))
            return None if entry is None or entry.counter is None else Mark(entry, entry.counter())
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return None

    def settle(self, mark: Mark, width: int, p2p: bool) -> None:
        """After a call numbered apart (``knowledge.library_shapes.NUMBERED_APART``): the numbers it took."""
        self._skew_after(mark.entry, mark.before, width)
        if p2p:
            self._claim_rest(mark.entry, mark.before)

    def resync(self) -> None:
        """After a call that ran several collectives: its numbers up to the counter are its own."""
        if self._multi is not None:
            entry, self._multi = self._multi, None
            try:
                last = _count(entry) - entry.base
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                return
            written = self._written.setdefault(entry.key, deque())
            written.extend(range(self.seqs.get(entry.key, 0) + 1, last + 1))
            self.seqs[entry.key] = max(self.seqs.get(entry.key, 0), last)

    def _skew_after(self, entry: GroupEntry, before: int, width: int) -> None:
        """A call numbered apart has returned: the counter numbers it took beyond ``width`` are not
        the collective numbering's, so later calls' numbers stay aligned with their peers'."""
        try:
            taken = _count(entry) - before
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if taken == width:
            return
        entry.skew += taken - width
        self._on_skew()   # the C hot path remembers a group's skew with its last call
        skews = self._skews.setdefault(entry.key, Skews([], []))
        skews.offsets.append(before - entry.base + taken + 1)
        skews.shifts.append(entry.skew)

    def _claim_rest(self, entry: GroupEntry, before: int) -> None:
        """After a P2P call: the counter numbers it took past the one claimed when it started (send_object_list and
        recv_object_list send the size, then the data) are a Python call's too, not C++-issued collectives."""
        try:
            after = _count(entry)
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if after > before + 1:
            entry.written.extend(range(before - entry.base + 2, after - entry.base + 1))

    # -- batch_isend_irecv --------------------------------------------------

    def batch_marks(self, p2p_op_list: list, out: RecordBatch) -> list[Mark]:
        """A mark for each group a batch of P2P ops runs on, the group marked busy.

        A batch advances its groups' collective counters by a number the backend decides (gloo: one per
        op), and the sidecar must not take those numbers for C++-issued collectives."""
        marks = []
        for pg in {id(p.group): p.group for p in p2p_op_list}.values():
            try:
                entry = self.group(pg, out)
                if entry.counter is not None:
                    marks.append(Mark(entry, entry.counter()))
                    self._hot.busy_group = entry.key
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                continue
        return marks

    def claim_batch(self, marks: list[Mark]) -> None:
        """After the batch: every number its groups counted meanwhile is the batch's (written by Python)."""
        for mark in marks:
            entry = mark.entry
            try:
                after = _count(entry)
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                continue
            entry.written.extend(range(mark.before - entry.base + 1, after - entry.base + 1))
            self._skew_after(entry, mark.before, 0)   # a batch is P2P: none of its numbers are collectives'
        self._hot.busy_group = None   # after the numbers: the sidecar reads it first


def _count(entry: GroupEntry) -> int:
    """The group's counter now. Only a group with one gets here; one without raises as calling None would,
    inside the caller's ``try`` (a numbering hook's failure, counted)."""
    counter = entry.counter
    if counter is None:
        raise TypeError("'NoneType' object is not callable")
    return counter()
