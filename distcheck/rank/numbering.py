"""The tracer's numbering: each process group's entry (``GroupEntry``) and the numbers its calls get.

A call on a group is numbered from the group's own collective counter where it has one (so a
C++-issued call between two Python calls leaves its number free for the sidecar, ``rank.native``);
calls the backend numbers apart (P2P, gloo's ``monitored_barrier``: ``knowledge.library_shapes``)
shift the numbering after them so a rank's numbers stay aligned with its peers'. Mixed into
``rank.tracer.Tracer``, whose state it reads.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from distcheck.files.trace import SEQ_BITS, RecordBatch, clean, group_record
from distcheck.rank.groups import counter_of, members_of
from distcheck.rank.guard import Hook, failed
from distcheck.rank.ops import MULTI_SEQ, UNCOUNTED, new_group_sequence


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


class Numbering:
    """The numbering half of ``Tracer`` (its state: ``_groups``, ``_seq``, ``_gids``, ``_written``, ``_bases``,
    ``_skews``, ``_multi``, ``busy_group``; ``_forget_remembered_calls`` when a group's skew moves)."""

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

    def seq_base(self, group: str) -> int:
        """The group's counter when this segment started (numbers in the trace count from it)."""
        return self._bases.get(group, 0)

    def _skew_after(self, entry: GroupEntry, before: int, width: int) -> None:
        """A call numbered apart has returned: the counter numbers it took beyond ``width`` are not
        the collective numbering's, so later calls' numbers stay aligned with their peers'."""
        try:
            taken = entry.counter() - before
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if taken == width:
            return
        entry.skew += taken - width
        self._forget_remembered_calls()   # the C hot path remembers a group's skew with its last call
        offsets, skews = self._skews.setdefault(entry.key, ([], []))
        offsets.append(before - entry.base + taken + 1)
        skews.append(entry.skew)

    def _settle(self, mark: Mark, width: int, p2p: bool) -> None:
        """After a call numbered apart (``knowledge.library_shapes.NUMBERED_APART``): the numbers it took."""
        self._skew_after(mark.entry, mark.before, width)
        if p2p:
            self._claim_rest(mark.entry, mark.before)

    def _claim_rest(self, entry: GroupEntry, before: int) -> None:
        """After a P2P call: the counter numbers it took past the one claimed when it started (send_object_list and
        recv_object_list send the size, then the data) are a Python call's too, not C++-issued collectives."""
        try:
            after = entry.counter()
        except Exception as exc:   # the numbers stay as they were: counted (coverage note)
            failed(Hook.NUMBERING, exc)
            return
        if after > before + 1:
            entry.written.extend(range(before - entry.base + 2, after - entry.base + 1))

    def _mark(self, pg: Any) -> Mark | None:
        """(the group's entry, its counter now) before a call numbered apart starts."""
        try:
            entry = self._groups.get(id(pg if pg is not None else self._default_group()))
            return None if entry is None or entry.counter is None else Mark(entry, entry.counter())
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

    def _batch_counters(self, p2p_op_list: list) -> list[Mark]:
        """(group entry, its counter now) for each group a batch of P2P ops runs on, the group marked busy.

        A batch advances its groups' collective counters by a number the backend decides (gloo: one per
        op), and the sidecar must not take those numbers for C++-issued collectives."""
        claims = []
        defs = RecordBatch()
        with self._defining:
            for pg in {id(p.group): p.group for p in p2p_op_list}.values():
                try:
                    entry = self._group(pg, defs)
                    if entry.counter is not None:
                        claims.append(Mark(entry, entry.counter()))
                        self.busy_group = entry.key
                except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                    failed(Hook.NUMBERING, exc)
                    continue
            if defs:
                self.writer.write(defs.data())
        return claims

    def _claim_batch(self, claims: list[Mark]) -> None:
        """After the batch: every number its groups counted meanwhile is the batch's (written by Python)."""
        for entry, before in claims:
            try:
                after = entry.counter()
            except Exception as exc:   # the numbers stay as they were: counted (coverage note)
                failed(Hook.NUMBERING, exc)
                continue
            entry.written.extend(range(before - entry.base + 1, after - entry.base + 1))
            self._skew_after(entry, before, 0)   # a batch is P2P: none of its numbers are collectives'
        self.busy_group = None   # after the numbers: the sidecar reads it first

    def _group(self, pg: Any, out: RecordBatch) -> GroupEntry:
        """The group's entry, defined on first use."""
        if pg is None:
            pg = self._default_group()
            if pg is None:
                raise RuntimeError("no default process group")   # the call itself will say so
        entry = self._groups.get(id(pg))
        if entry is not None and entry.pg is pg:
            return entry
        key, ranks = self._resolve_group(pg)
        key = clean(key or str(len(self._groups)))
        written = self._written.setdefault(key, deque())
        gid = self._gid(key, ranks, out)
        skews = self._skews.get(key)
        entry = self._groups[id(pg)] = GroupEntry(key, pg, gid, counter_of(pg), self._bases.get(key, 0), written,
                                                  gid << SEQ_BITS, gid << 8, skews[1][-1] if skews else 0)
        self._seq.setdefault(key, 0)
        return entry

    def _gid(self, key: str, ranks: Any, out: RecordBatch) -> int:
        """The trace's id for a group (or p2p pair), defined on first use."""
        gid = self._gids.get(key)
        if gid is None:
            gid = self._gids[key] = len(self._gids)
            out.define(group_record(gid, key, ranks))
        return gid

    def _number(self, name: str, entry: GroupEntry, out: RecordBatch, extra: tuple | None = None) -> tuple[str, int]:
        """(group, seq) for a call on a group: the group's own counter + 1, where it has one."""
        key, counter, base, written = entry.key, entry.counter, entry.base, entry.written
        if name in UNCOUNTED:   # new_group: its own sequence (ops.new_group_sequence)
            key, ranks = new_group_sequence(extra, self.rank, members_of(entry.pg))
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
        if entry.counter is not None:
            entry.written.append(entry.counter() - entry.base + 1)
            self.busy_group = entry.key
