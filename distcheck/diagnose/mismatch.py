"""Structural mismatches: ranks that meet at one (group, seq) with a different
op, reduce op, shape, dtype, device, root, group or new_group members, all_to_all
split sizes that do not pair up (``splits``), and send/recv pairs whose buffers differ. Same signature but a
different metric/module is a crossing (``order``), judged in the same pass. Pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distcheck.diagnose.backend_error import _ITEM_BYTES
from distcheck.diagnose.common import Table, detail, majority, who
from distcheck.diagnose.order import crossing_finding
from distcheck.diagnose.splits import broken_pairs, odd_side, splits_finding
from distcheck.knowledge.library_shapes import waits_elsewhere, wire_op
from distcheck.models import JOIN_LABEL, UNKNOWN_OP, Event, Finding, GroupKey, Kind, Severity
from distcheck.text import field_value, plural, rank_list


# Fingerprint fields compared across ranks: (name in findings, Event attribute).
COMPARED = (
    ("op", "op"), ("reduce_op", "reduce_op"), ("shape", "shapes"), ("dtype", "dtypes"),
    ("device", "device"), ("root", "root"), ("group", "group_ranks"), ("members", "members"),
)
COMPARED_FIELDS = tuple(name for name, _ in COMPARED)
P2P_COMPARED = ("shape", "dtype", "device")
MAX_REPORTED_PER_GROUP = 5
SEND_OPS = ("send", "isend", "send_object_list")

# What a difference in each field does, in words a user can act on. Shape, dtype and reduce op depend on the
# buffers' byte sizes and on the backend: ``consequence`` says them for the call at hand.
CONSEQUENCE = {
    "op": "different collectives were paired with each other",
    "reduce_op": "no backend checks the reduce op: the call completes without an error and its result is wrong",
    "shape": "the buffers differ in size",
    "dtype": "the buffers differ in byte size or meaning",
    "device": "ranks passed tensors on different devices",
    "root": "ranks disagree about which rank sends or receives",
    "group": "ranks disagree about who is in the process group",
    "members": ("the ranks create their process groups in a different order, so the same group name has "
                "different members on different ranks: creating it waits forever, or later calls pair the "
                "wrong ranks. Create subgroups in the same order on every rank"),
}


# What each backend does with buffers of different byte sizes (gloo checks the size it receives; NCCL checks nothing)
_SIZE_ON = {"gloo": "gloo aborts the rank that receives more bytes than it expects",
            "nccl": "NCCL checks nothing: the call hangs, or reads and writes past the smaller buffer"}


def _nbytes(e: Event) -> int | None:
    sizes = [math.prod(shape) * _ITEM_BYTES[dtype] for shape, dtype in zip(e.shapes, e.dtypes) if dtype in _ITEM_BYTES]
    return sum(sizes) if e.shapes and len(sizes) == len(e.shapes) else None


def _backends(events: Mapping[int, Event]) -> tuple[str, ...]:
    """The backends the call can be on, from its records: a call that returned before its work completed is on
    NCCL (or its emulation), CPU tensors only on gloo; CUDA tensors on either (gloo takes them too)."""
    if any(e.t_returned is not None for e in events.values()):
        return ("nccl",)
    return ("gloo",) if all(e.device == "cpu" for e in events.values()) else ("gloo", "nccl")


def consequence(fields: Sequence[str], events: Mapping[int, Event]) -> str:
    """What the differences do, true together and for the backend the call ran on: buffers of different byte
    sizes abort a gloo rank (then the reduce op's silence does not hold), buffers of equal byte size pass every
    check."""
    sizes = {_nbytes(e) for e in events.values()}
    differ = len(sizes) > 1 or None in sizes
    parts = []
    for f in fields:
        if f == "dtype" and "shape" in fields:
            continue   # one sentence on the buffers
        if f in ("shape", "dtype") and differ:
            known = sorted(n for n in sizes if n is not None)
            what = f" ({' vs '.join(f'{n:,} B' for n in known)})" if len(known) > 1 else ""
            parts.append(f"the buffers differ in byte size{what}: " + "; ".join(_SIZE_ON[b] for b in _backends(events)))
        elif f in ("shape", "dtype"):
            read = "shape" if f == "shape" else "dtype" if "shape" not in fields else "shape and dtype"
            parts.append(f"the buffers hold the same number of bytes ({sizes.pop():,}), so no backend notices: "
                         f"the call completes and each rank reads the others' elements as its own {read}")
        elif f == "reduce_op" and differ and any(x in fields for x in ("shape", "dtype")):
            parts.append("the reduce op alone would raise no error on any backend and give a wrong result")
        else:
            parts.append(CONSEQUENCE[f])
    return "; ".join(parts)


class _GroupIds:
    """Small stand-ins for member tuples, so signatures hash fast on 1000+ ranks."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[tuple[int, ...], int]] = {}
        self._by_value: dict[tuple[int, ...], int] = {}

    def __call__(self, members: tuple[int, ...]) -> int:
        hit = self._by_id.get(id(members))
        if hit is None or hit[0] is not members:
            hit = self._by_id[id(members)] = (members, self._by_value.setdefault(members, len(self._by_value)))
        return hit[1]


_ATTRS = dict(COMPARED)


def _value(e: Event, name: str, members: tuple[int, ...]) -> Any:
    if name == "group":
        return e.group_ranks or members   # unknown membership (torn trace): assume it agrees
    return getattr(e, _ATTRS[name])


def _signature(e: Event, members: tuple[int, ...], gid: _GroupIds | None = None, blur: bool = False) -> tuple:
    """The compared fields; ``blur`` drops what a C++-issued call's record cannot know (reduce op,
    device, root), so a Python call and a C++ one are compared on op, shapes, dtypes and group only."""
    group = e.group_ranks or members
    # A C++ call is named by its algorithm (funcol's all_gather is gloo's allgather, as all_gather_into_tensor).
    if blur:
        return (wire_op(e.op), None, e.shapes, e.dtypes, None, None, gid(group) if gid else group, None)
    return (e.op, e.reduce_op, e.shapes, e.dtypes, e.device, e.root, gid(group) if gid else group, e.members)


def _shadow(e: Event) -> bool:
    """A call torch's Join made for a rank out of data: it matches any label on purpose."""
    return e.label is not None and (e.label == JOIN_LABEL or e.label.startswith(JOIN_LABEL + " ("))


def _has_native(events: Mapping[int, Event]) -> bool:
    return any(e.native for e in events.values())


def _p2p_signature(e: Event) -> tuple:
    return (e.shapes, e.dtypes, e.device)



def find_mismatches(table: Table) -> list[Finding]:
    """The first divergence of every group, and each later one that differs in another way."""
    findings: list[Finding] = []
    gid = _GroupIds()
    for (group, members), seqs in sorted(table.items()):
        pair = group.is_p2p   # a P2P pair: two ranks
        first: dict[tuple, Finding] = {}
        repeats: dict[tuple, list[int]] = defaultdict(list)
        for seq in sorted(seqs):
            events = seqs[seq]
            if len(events) < 2:
                continue
            # Judge cheaply first; build the full finding (details for every rank) only for a new kind of difference.
            finding: Finding | None = None
            verdict: _Verdict | None = None
            if pair:   # two ranks: cheap to build right away
                finding = _p2p_mismatch_at(group, seq, events)
                key = (finding.kind, finding.fields, finding.odd_ranks, finding.tie) if finding else None
            else:
                verdict = _judge(members, events, gid)
                key = verdict.key if verdict else None
            if not key:
                continue
            if key in first:
                repeats[key].append(seq)
            elif len(first) < MAX_REPORTED_PER_GROUP:
                if finding is not None:
                    first[key] = finding
                elif verdict is not None:
                    first[key] = _build(verdict, group, members, seq, events, gid)
        findings.extend(_with_repeats(f, repeats[key]) for key, f in first.items())
    return findings


def _with_repeats(f: Finding, seqs: list[int]) -> Finding:
    if not seqs:
        return f
    shown = ", ".join(f"#{s}" for s in seqs[:8]) + (", ..." if len(seqs) > 8 else "")
    summary = f"{f.summary} The same difference repeats at {plural(len(seqs), 'later call')} ({shown})."
    return dataclasses.replace(f, summary=summary, data={**f.data, "repeated_at": seqs})


def _differing(sigs: Mapping[int, tuple], fields: Sequence[str], expected: tuple | None,
               odd: list[int]) -> tuple[str, ...]:
    if expected is None:   # a tie: every field that takes more than one value
        return tuple(f for i, f in enumerate(fields) if len({s[i] for s in sigs.values()}) > 1)
    return tuple(f for i, f in enumerate(fields) if any(sigs[r][i] != expected[i] for r in odd))


@dataclass(frozen=True)
class _Verdict:
    """How the ranks at one (group, seq) differ, before any text is written."""

    kind: Kind                     # MISMATCH or ORDER
    fields: tuple[str, ...]
    odd: tuple[int, ...]
    tie: bool
    expected: Any                  # the majority signature or label; None on a tie

    @property
    def key(self) -> tuple:
        return (self.kind, self.fields, self.odd, self.tie)


def _judge(members: tuple[int, ...], events: Mapping[int, Event], gid: _GroupIds) -> _Verdict | None:
    if waits_elsewhere(events):
        return None   # a barrier against a data call, still waiting: a hang at two lines (diagnose.hang)
    native = _has_native(events)
    if native and any(e.op == UNKNOWN_OP for e in events.values()):
        return None   # a C++ call that left the Flight Recorder's ring before it was read: nothing to compare
    sigs = {r: _signature(e, members, gid, native) for r, e in events.items()}
    if len(set(sigs.values())) > 1:
        expected, odd, tie = majority(sigs)
        return _Verdict(Kind.MISMATCH, _differing(sigs, COMPARED_FIELDS, expected, odd), tuple(odd), tie, expected)
    if not native:
        pairs = broken_pairs(members, events)
        if pairs:
            odd_splits, tie = odd_side(pairs, members)
            return _Verdict(Kind.MISMATCH, ("splits",), odd_splits, tie, tuple(pairs))
    # Same signature, different metric/module: the backend pairs them silently. Only the label counts:
    # the same label reached from different lines (if rank == 0: broadcast(a) else: broadcast(b)) is ordinary code.
    # Crossed calls need a module on every side: a side with none is plain code, e.g. Join's shadow
    # all_reduces for ranks out of data, matching DDP.forward's on purpose. A C++-issued call's label
    # is read from a stack sampled a little later, so it is never compared.
    labels = {r: e.label for r, e in events.items() if not _shadow(e)}
    if not native and None not in labels.values() and len(set(labels.values())) > 1:
        expected, odd, tie = majority(labels)
        return _Verdict(Kind.ORDER, ("label",), tuple(odd), tie, expected)
    return None


def _build(v: _Verdict, group: GroupKey, members: tuple[int, ...], seq: int, events: Mapping[int, Event],
           gid: _GroupIds) -> Finding:
    role = lambda r: "tie" if v.tie else ("odd" if r in v.odd else "majority")  # noqa: E731
    details = tuple(detail(r, role(r), e) for r, e in sorted(events.items()))
    if v.kind is Kind.ORDER:
        return crossing_finding(group, seq, events, details, v.odd, v.tie, v.expected)
    if v.fields == ("splits",):
        return splits_finding(group, seq, members, events, v.expected, v.odd, v.tie)
    blur = _has_native(events)
    ref = None if v.tie else next(e for _, e in sorted(events.items())
                                  if _signature(e, members, gid, blur) == v.expected)
    op, label, callsite = (ref.op, ref.label, ref.callsite) if ref else _common(events.values())
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group=group, seq=seq, op=op,
        label=label, callsite=callsite, odd_ranks=v.odd, fields=v.fields,
        majority=ref.fingerprint() if ref else None, tie=v.tie, ranks=details,
        summary=_mismatch_summary(seq, group, members, v.fields, events, ref, list(v.odd)),
        data={"values": _values_by_field(v.fields, events, members)},
    )


def _common(events: Iterable[Event]) -> tuple[str | None, str | None, str | None]:
    """(op, label, callsite) where every rank agrees, None where they do not: a tie names no side."""
    events = list(events)
    return tuple(getattr(events[0], a) if len({getattr(e, a) for e in events}) == 1 else None  # type: ignore[return-value]
                 for a in ("op", "label", "callsite"))


def _values_by_field(fields: Sequence[str], events: Mapping[int, Event],
                     members: tuple[int, ...]) -> dict[str, dict[str, list[int]]]:
    """{field: {value as text: ranks}} — both sides of every difference, for people and tools."""
    out: dict[str, dict[str, list[int]]] = {}
    for f in fields:
        by_value: dict[str, list[int]] = defaultdict(list)
        for r, e in sorted(events.items()):
            by_value[field_value("group" if f == "members" else f, _value(e, f, members))].append(r)
        out[f] = dict(by_value)
    return out


def _mismatch_summary(seq: int, group: GroupKey, members: tuple[int, ...], fields: tuple[str, ...],
                      events: Mapping[int, Event], ref: Event | None, odd: list[int]) -> str:
    values = _values_by_field(fields, events, members)
    diffs = "; ".join(f"{f} " + " vs ".join(f"{v} on {rank_list(rs)}" for v, rs in by.items())
                      for f, by in values.items())
    ops = "/".join(dict.fromkeys(e.op for _, e in sorted(events.items())))
    said = consequence(fields, events)
    if fields == ("members",):
        return _members_summary(seq, events, values["members"], said)
    if ref is None:
        calls = "; ".join(f"{rank_list([r])} {who(e)}" for r, e in sorted(events.items()))
        return (f"{ops} #{seq} (group {group}): the ranks disagree on {' and '.join(fields)} and no side has a "
                f"majority (a tie) — {diffs}. Calls: {calls}. Consequence: {said}.")
    odd_e = events[odd[0]]
    return (f"{ops} #{seq} (group {group}): {rank_list(odd)} called it with a different {' and '.join(fields)} "
            f"than the majority — {diffs}. Majority: {who(ref)}; {rank_list(odd)}: {who(odd_e)}. "
            f"Consequence: {said}.")


def _members_summary(seq: int, events: Mapping[int, Event], by_value: Mapping[str, list[int]],
                     consequence: str) -> str:
    """new_group: each side's member list and the line that created it."""
    sides = "; ".join(f"{value} on {rank_list(rs)} ({who(events[rs[0]])})" for value, rs in by_value.items())
    return (f"new_group #{seq}: the group created by this call has different members on different ranks — "
            f"{sides}. The creation order of subgroups differs by rank. Consequence: {consequence}.")


def _p2p_mismatch_at(group: GroupKey, seq: int, events: Mapping[int, Event]) -> Finding | None:
    """A send and its matching receive must agree on the buffer: shape, dtype, device."""
    sends = {r: e for r, e in events.items() if e.op in SEND_OPS}
    recvs = {r: e for r, e in events.items() if e.op not in SEND_OPS}
    if len(sends) != 1 or len(recvs) != 1:
        return None
    (src, send), (dst, recv) = next(iter(sends.items())), next(iter(recvs.items()))
    if not send.shapes or not recv.shapes:   # object lists: nothing to compare
        return None
    sigs = {src: _p2p_signature(send), dst: _p2p_signature(recv)}
    fields = _differing(sigs, P2P_COMPARED, None, [])
    if not fields:
        return None
    diffs = "; ".join(f"{f} {field_value(f, _value(send, f, ()))} sent by rank {src} vs "
                      f"{field_value(f, _value(recv, f, ()))} expected by rank {dst}" for f in fields)
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group=group, seq=seq, op=send.op, label=send.label,
        callsite=send.callsite, fields=fields, tie=True,
        ranks=(detail(src, "sender", send), detail(dst, "receiver", recv)),
        data={"values": _values_by_field(fields, events, ())},
        summary=(f"{send.op} #{seq} from rank {src} to rank {dst}: the buffers differ — {diffs}. "
                 f"Sender {who(send)}; receiver {who(recv)}. Consequence: {consequence(fields, events)}."),
    )
