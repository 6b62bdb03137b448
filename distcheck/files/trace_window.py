"""A long trace's window: what of a rank's trace crosses to node 0 on a multi-node run.

A 10-minute pre-flight writes ~100 calls a second per rank; at 4,096 ranks the whole traces are
gigabytes, and node 0 could neither hold nor judge them in time. So a node sends node 0 each rank's
trace whole only while it has at most ``WHOLE_UP_TO`` calls. A longer one goes as its *window*: every
definition, the rank's last ``KEEP_CALLS`` calls, and for each group a digest of every block of
``BLOCK`` calls before them (the op and reduce op of each call, by number). The whole trace stays in
the node's own launch dir, and the window says where (an ``H`` record).

On node 0 (``common_window``), every rank's calls of a group are cut at the same number, the highest
any window of that group starts at, so the analysis compares ranks on the calls all of them kept
(a call one rank's window lacks is then never taken for a lost record or a divergence). The blocks
before the cut are compared by digest (``diagnose.windows``): ranks that issued another op or reduce op
there are found, the records that would name the call stay on the nodes.

The records this module adds to the format (``files.trace`` reads them into ``Tables``):

    K  group  first-kept-seq  calls-elided  block:digest,block:digest,...
    H  node  path-of-the-whole-trace
"""

from __future__ import annotations

import hashlib
from array import array
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from itertools import compress

from distcheck.files.trace import (NONE, SEQ_MASK, SLOT, SYNC_OFFSET, TAG_E, TAG_T, Tables, clean, first_bad,
                                   slot_words, text_at, text_slots, used_bytes)
from distcheck.models.group_key import is_p2p

if TYPE_CHECKING:
    from distcheck.files.trace_reader import RankTrace

WHOLE_UP_TO = 1000     # calls: a rank's trace with no more than this crosses whole
KEEP_CALLS = 64        # the last calls of a longer trace that cross to node 0
BLOCK = 256            # calls per digest of the calls before the window
_TAG_T_BYTE = bytes([TAG_T])   # a slot's first byte is its tag


@dataclass(frozen=True)
class Elided:
    """What a rank's copy on node 0 lacks of one group: calls before ``first_kept``, compared by digest."""

    first_kept: int                        # the first call number kept (every call before it was cut)
    count: int                             # how many of the rank's calls were cut
    digests: Mapping[int, str] = field(default_factory=dict)   # block -> digest, for complete blocks cut
    held_at: tuple[int, str] | None = None  # (node, path) of the rank's whole trace; None: node 0 has it


_P2P_SIDES = {"send": "p2p", "isend": "p2p", "recv": "p2p", "irecv": "p2p", "send_object_list": "p2p_object",
              "recv_object_list": "p2p_object"}


def digest_op(group: str, op: str) -> str:
    """The op a digest holds for a call of ``group``: a P2P pair's sender records ``send`` and its receiver ``recv``
    at the same number by design, so both sides hold one word (their digests differed in every block: a mismatch
    of every pipeline's pairs)."""
    return _P2P_SIDES.get(op, op) if is_p2p(group) else op


def digest_of(calls: Iterable[tuple[int, str, str | None]]) -> dict[int, str]:
    """Block -> digest of (seq, op, reduce op) of every call in it, for the blocks ``calls`` fill.

    A block is calls ``b * BLOCK + 1`` to ``(b + 1) * BLOCK`` of one group; a block with a number missing
    gets no digest (there is nothing whole to compare)."""
    blocks: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
    for seq, op, reduce_op in calls:
        blocks[(seq - 1) // BLOCK].append((seq, op, reduce_op or NONE))
    out = {}
    for block, items in blocks.items():
        whole = list(range(block * BLOCK + 1, (block + 1) * BLOCK + 1))
        if [s for s, _, _ in items] != whole:   # calls usually come in order: sorted only when not
            items.sort()
            if [s for s, _, _ in items] != whole:
                continue
        out[block] = hashlib.blake2b(_block_text(items).encode(), digest_size=8).hexdigest()
    return out


def _block_text(items: list[tuple[int, str, str]]) -> str:
    """``seq:op:reduce_op;`` of every call of a block, in one string (hashed in one update)."""
    _, op, reduce_op = items[0]
    if all(o == op and r == reduce_op for _, o, r in items):   # the usual block: one op throughout
        tail = f":{op}:{reduce_op};"
        return tail.join(map(str, (s for s, _, _ in items))) + tail
    return "".join([f"{seq}:{op}:{reduce_op};" for seq, op, reduce_op in items])


def window(data: bytes, node: int, held_at: str, keep: int = KEEP_CALLS, whole_up_to: int = WHOLE_UP_TO) -> bytes:
    """The bytes of ``data`` (a whole trace file) that cross to node 0: all of it while it is short (or a
    batched launch's, whose scenarios restart their numbers), else its window."""
    used = used_bytes(data)
    n = used // SLOT
    words = slot_words(memoryview(data), n)
    good = first_bad(words, 0, n)
    # Each slot's first byte is its tag: the text and enter records are found in C, not slot by slot in
    # Python (a node cuts the windows of all its ranks' traces of 10,000s of calls at once).
    tags = bytes(memoryview(data)[:good * SLOT:SLOT])
    tables = Tables()
    texts: list[tuple[int, int]] = []                  # (first slot, end slot) of each text record
    i = tags.find(_TAG_T_BYTE)
    while i != -1:
        text, j = text_at(words, i, good)
        if not text.complete:
            good = i   # a text cut short: nothing from here on is read
            break
        line = text.text()
        if line.startswith(("B\t", "K\t")):
            return data   # a batched launch's trace, or one already cut: sent as it is
        tables.define(line)
        texts.append((i, j))
        i = tags.find(_TAG_T_BYTE, j)
    enters = _Enters.of(words, tables, tags[:good])
    if len(enters.slots) <= whole_up_to:
        return data
    return _windowed(data, used, texts, enters, len(enters.slots) - keep, node, held_at)


@dataclass
class _Enters:
    """The E records of a trace whose ids are defined, as columns: a call's slot, first word (its call
    site: group, op and reduce op, in ``call_of``) and number. Columns, because a node cuts the windows
    of its ranks' traces of 10,000s of calls at once: they are read in C, not record by record."""

    slots: list[int]
    w0s: list[int]
    seqs: list[int]
    call_of: dict[int, tuple[str, str, str]]

    @classmethod
    def of(cls, words: array, tables: Tables, tags: bytes) -> _Enters:
        mask = tags.translate(_E_MASK)   # 1 at each E record, 0 elsewhere
        end = 4 * len(tags)
        slots = list(compress(range(len(tags)), mask))
        w0s = list(compress(words[0:end:4], mask))
        seqs = [w & SEQ_MASK for w in compress(words[1:end:4], mask)]
        calls = {w0: _call(tables, w0) for w0 in set(w0s)}
        undefined = {w0 for w0, call in calls.items() if call is None}
        if undefined:   # a call whose definition was lost: left out, as the reader leaves it out
            keep = [k for k, w0 in enumerate(w0s) if w0 not in undefined]
            slots, w0s, seqs = [slots[k] for k in keep], [w0s[k] for k in keep], [seqs[k] for k in keep]
        return cls(slots, w0s, seqs, {w0: call for w0, call in calls.items() if call is not None})

    def by_group(self, end: int) -> dict[str, tuple[list[int], list[int]]]:
        """group -> (seqs, first words) of the calls before index ``end``, in trace order."""
        groups = {self.call_of[w0][0] for w0 in set(self.w0s[:end])}
        if len(groups) == 1:   # the usual trace: every call in one group
            return {groups.pop(): (self.seqs[:end], self.w0s[:end])}
        out: dict[str, tuple[list[int], list[int]]] = {g: ([], []) for g in groups}
        for seq, w0 in zip(self.seqs[:end], self.w0s[:end]):
            seqs, w0s = out[self.call_of[w0][0]]
            seqs.append(seq)
            w0s.append(w0)
        return out


_E_MASK = bytes(1 if tag == TAG_E else 0 for tag in range(256))


def _call(tables: Tables, w0: int) -> tuple[str, str, str] | None:
    """(group, op, reduce op) of an E record's first word."""
    s = tables.shared.get(w0) or tables.shared_of(w0)
    if s is None:
        return None
    group, op, rest = s
    return group, digest_op(group, op), rest[0] or NONE


def _windowed(data: bytes, used: int, texts: list[tuple[int, int]], enters: _Enters, kept_from: int,
              node: int, held_at: str) -> bytes:
    cut = enters.slots[kept_from]
    first_kept: dict[str, int] = {}
    for w0, seq in zip(enters.w0s[kept_from:], enters.seqs[kept_from:]):
        group = enters.call_of[w0][0]
        first_kept[group] = min(seq, first_kept.get(group, seq))
    lines = []
    for group, (seqs, w0s) in sorted(enters.by_group(kept_from).items()):
        first = first_kept.get(group, max(seqs) + 1)
        blocks = _digests_before(first, seqs, w0s, enters.call_of)
        digests = ",".join(f"{b}:{d}" for b, d in sorted(blocks.items()))
        lines.append(f"K\t{clean(group)}\t{first}\t{len(seqs)}\t{digests or NONE}\n")
    lines.append(f"H\t{node}\t{clean(held_at)}\n")
    header = data[:SYNC_OFFSET + SLOT]
    before = b"".join(data[a * SLOT:b * SLOT] for a, b in texts if a < cut and a * SLOT >= len(header))
    return header + text_slots("".join(lines).encode()) + before + data[cut * SLOT:used]


def _digests_before(first: int, seqs: list[int], w0s: list[int], call_of: Mapping[int, tuple[str, str, str]]
                    ) -> dict[int, str]:
    """``digest_of`` the calls numbered below ``first`` (one group's, ``seqs`` with their first words).

    The usual group's calls come numbered one after another: then a block is a slice of the columns, and
    a block whose calls share one op and reduce op is hashed without a tuple per call."""
    start = seqs[0] if seqs else 1
    if seqs != list(range(start, start + len(seqs))):
        return digest_of((seq, *call_of[w0][1:]) for seq, w0 in zip(seqs, w0s) if seq < first)
    out = {}
    last = min(first - 1, start + len(seqs) - 1)     # the last call number digested
    for block in range(-(-(start - 1) // BLOCK), last // BLOCK):   # the blocks [start, last] holds whole
        lo = block * BLOCK + 1
        sites = w0s[lo - start:lo - start + BLOCK]
        kinds = {call_of[w0][1:] for w0 in set(sites)}
        if len(kinds) == 1:
            op, reduce_op = kinds.pop()
            tail = f":{op}:{reduce_op};"
            text = tail.join(map(str, range(lo, lo + BLOCK))) + tail
        else:
            text = _block_text([(lo + k, *call_of[w0][1:]) for k, w0 in enumerate(sites)])
        out[block] = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return out


def elided_of(tables: Tables) -> dict[str, Elided]:
    """The ``K`` and ``H`` records a window's ``Tables`` read: group -> what its copy lacks."""
    held = tables.held_at
    return {group: Elided(first, count, digests, held) for group, (first, count, digests) in tables.kept.items()}


def common_window(traces: Mapping[int, RankTrace]) -> None:
    """Cut every rank's calls of a group at the same number, the highest its windows start at, in place
    (``traces``: rank -> ``trace_reader.RankTrace``); a rank node 0 has whole gets, for the calls cut,
    the digests its window would have carried, so that every rank's blocks can be compared."""
    cuts: dict[str, int] = {}
    for trace in traces.values():
        for group, e in trace.elided.items():
            cuts[group] = max(cuts.get(group, 0), e.first_kept)
    if not cuts:
        return
    for trace in traces.values():
        cut_calls: dict[str, list[tuple[int, str, str | None]]] = defaultdict(list)
        kept = []
        for call in trace.events:
            cut = cuts.get(call.group)
            if cut is not None and call.seq < cut:
                cut_calls[call.group].append((call.seq, digest_op(call.group, call.op), call.reduce_op))
            else:
                kept.append(call)
        if not cut_calls:
            continue
        trace.events[:] = kept
        for group, calls in cut_calls.items():
            had = trace.elided.get(group)
            if had is None:
                trace.elided[group] = Elided(cuts[group], len(calls), digest_of(calls))
            else:   # a window that starts below the common cut: its own calls up to the cut are digested too
                more = digest_of(calls)
                trace.elided[group] = Elided(cuts[group], had.count + len(calls),
                                             {**had.digests, **more}, had.held_at)
