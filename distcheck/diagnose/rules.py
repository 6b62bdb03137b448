"""Pure analysis: per-rank events + rank outcomes + scenario results → findings.

No I/O, no printing, no process groups. Calls are matched by (group, sequence
number); what was *expected* at a sequence number is decided by majority, and
a tie is stated as a tie — never "whichever rank file was read first".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from distcheck.models import Event, Finding, RankDetail, RankOutcome
from distcheck.text import field_value, gib, id_list, plural, rank_list, signed, site

# Fingerprint fields compared across ranks: (name in findings, Event attribute).
COMPARED = (
    ("op", "op"), ("reduce_op", "reduce_op"), ("shape", "shapes"), ("dtype", "dtypes"),
    ("device", "device"), ("root", "root"), ("group", "group_ranks"),
)
COMPARED_FIELDS = tuple(name for name, _ in COMPARED)
P2P_COMPARED = ("shape", "dtype", "device")
MAX_REPORTED_PER_GROUP = 5
ABNORMAL_ENDS = ("stall", "timeout", "crash", "interrupted")
SEND_OPS = ("send", "isend", "send_object_list")

# What a difference in each field does, in words a user can act on.
CONSEQUENCE = {
    "op": "different collectives were paired with each other",
    "reduce_op": "the call completes without any error on every backend, but its result is wrong",
    "shape": "the buffers differ in size: gloo aborts a rank, NCCL hangs or corrupts memory",
    "dtype": "the buffers differ in byte size or meaning: gloo aborts a rank, NCCL hangs or returns garbage",
    "device": "ranks passed tensors on different devices",
    "root": "ranks disagree about which rank sends or receives",
    "group": "ranks disagree about who is in the process group",
}

GroupKey = tuple[str, tuple[int, ...]]   # (group name, member ranks)
Table = Mapping[GroupKey, Mapping[int, Mapping[int, Event]]]


@dataclass(frozen=True)
class RunFacts:
    """What the launcher knows about how the run ended."""

    world_size: int
    end_reason: str = "completed"        # completed, stall, crash, timeout, max_duration, interrupted
    stall_onset: float | None = None     # wall time of the last progress
    detected_at: float | None = None     # wall time the stall was declared
    timeout_s: float | None = None
    straggler_min_lag_s: float = 0.1
    oom_kills: int | None = None         # OOM kills counted in distcheck's memory cgroup (None: no counter)


# -- matching ---------------------------------------------------------------


def _components(member_sets: Iterable[tuple[int, ...]]) -> list[set[int]]:
    """Merge overlapping member sets: ranks that share a group name and a rank meant the same group."""
    merged: list[set[int]] = []
    for members in member_sets:
        current = set(members)
        for other in [m for m in merged if m & current]:
            merged.remove(other)
            current |= other
        merged.append(current)
    return merged


def _member_sets(traces: Mapping[int, Sequence[Event]]) -> dict[str, set[tuple[int, ...]]]:
    sets: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for rank, events in traces.items():
        seen: dict[str, tuple[int, ...]] = {}
        for e in events:
            # Identity check first: hashing a 1000-rank tuple per event would dominate the run time.
            if seen.get(e.group) is not e.group_ranks:
                seen[e.group] = e.group_ranks
                sets[e.group].add(e.group_ranks or (rank,))
    return sets


def group_table(traces: Mapping[int, Sequence[Event]]) -> dict[GroupKey, dict[int, dict[int, Event]]]:
    """{(group, members): {seq: {rank: event}}} over every rank's events.

    Disjoint subgroups that happen to share a name stay apart; overlapping member
    lists under one name are merged, so ranks that disagree about a group's
    members meet at the same (group, seq) and show up as a ``group`` mismatch.
    """
    keys: dict[tuple[str, tuple[int, ...]], GroupKey] = {}
    for name, member_sets in _member_sets(traces).items():
        for component in _components(sorted(member_sets)):
            key = (name, tuple(sorted(component)))
            for members in member_sets:
                if set(members) <= component:
                    keys[(name, members)] = key
    table: dict[GroupKey, dict[int, dict[int, Event]]] = defaultdict(lambda: defaultdict(dict))
    for rank, events in traces.items():
        # Keep the group's own dict, not its key: hashing a 1000-rank member tuple per event is slow.
        cache: dict[str, tuple[tuple[int, ...], dict[int, dict[int, Event]]]] = {}
        for e in events:
            hit = cache.get(e.group)
            if hit is None or hit[0] is not e.group_ranks:
                hit = cache[e.group] = (e.group_ranks, table[keys[(e.group, e.group_ranks or (rank,))]])
            hit[1][e.seq][rank] = e
    return table


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


def _signature(e: Event, members: tuple[int, ...], gid: _GroupIds | None = None) -> tuple:
    group = e.group_ranks or members
    return (e.op, e.reduce_op, e.shapes, e.dtypes, e.device, e.root, gid(group) if gid else group)


def _p2p_signature(e: Event) -> tuple:
    return (e.shapes, e.dtypes, e.device)


def majority(values: Mapping[int, Any]) -> tuple[Any, list[int], bool]:
    """(majority value, odd ranks, tie) over rank → value. On a tie there is no odd side."""
    ranked = Counter(values.values()).most_common()
    top_value, top_count = ranked[0]
    if len(ranked) > 1 and ranked[1][1] == top_count:
        return None, [], True
    return top_value, sorted(r for r, v in values.items() if v != top_value), False


def _detail(rank: int, role: str, e: Event | None, **extra: Any) -> RankDetail:
    if e is None:
        return RankDetail(rank=rank, role=role, **extra)
    return RankDetail(rank=rank, role=role, op=e.op, seq=e.seq, label=e.label, callsite=e.callsite,
                      fingerprint=e.fingerprint(), **extra)


def _who(e: Event) -> str:
    label = f"{e.label} " if e.label else ""
    return f"{label}at {site(e.callsite)}"


def _call(e: Event) -> str:
    return f"{e.op} #{e.seq} (group {e.group})"


# -- structural mismatch and crossed calls ---------------------------------


def find_mismatches(table: Table) -> list[Finding]:
    """The first divergence of every group, and each later one that differs in another way."""
    findings: list[Finding] = []
    gid = _GroupIds()
    for (group, members), seqs in sorted(table.items()):
        p2p = group.startswith("p2p:")
        first: dict[tuple, Finding] = {}
        repeats: dict[tuple, list[int]] = defaultdict(list)
        for seq in sorted(seqs):
            events = seqs[seq]
            if len(events) < 2:
                continue
            # Judge cheaply first; build the full finding (details for every rank) only for a new kind of difference.
            if p2p:   # two ranks: cheap to build right away
                finding = _p2p_mismatch_at(group, seq, events)
                key = finding and (finding.kind, finding.fields, finding.odd_ranks, finding.tie)
            else:
                verdict = _judge(members, events, gid)
                key = verdict and verdict.key
            if not key:
                continue
            if key in first:
                repeats[key].append(seq)
            elif len(first) < MAX_REPORTED_PER_GROUP:
                first[key] = finding if p2p else _build(verdict, group, members, seq, events, gid)
        findings.extend(_with_repeats(f, repeats[key]) for key, f in first.items())
    return findings


def _with_repeats(f: Finding, seqs: list[int]) -> Finding:
    if not seqs:
        return f
    shown = ", ".join(f"#{s}" for s in seqs[:8]) + (", ..." if len(seqs) > 8 else "")
    summary = f"{f.summary} The same difference repeats at {plural(len(seqs), 'later call')} ({shown})."
    return dataclasses.replace(f, summary=summary, data={**f.data, "repeated_at": seqs})


def _differing(sigs: Mapping[int, tuple], fields: Sequence[str], expected: tuple | None, odd: list[int]) -> tuple[str, ...]:
    if expected is None:   # a tie: every field that takes more than one value
        return tuple(f for i, f in enumerate(fields) if len({s[i] for s in sigs.values()}) > 1)
    return tuple(f for i, f in enumerate(fields) if any(sigs[r][i] != expected[i] for r in odd))


@dataclass(frozen=True)
class _Verdict:
    """How the ranks at one (group, seq) differ, before any text is written."""

    kind: str                      # mismatch or order
    fields: tuple[str, ...]
    odd: tuple[int, ...]
    tie: bool
    expected: Any                  # the majority signature or label; None on a tie

    @property
    def key(self) -> tuple:
        return (self.kind, self.fields, self.odd, self.tie)


def _judge(members: tuple[int, ...], events: Mapping[int, Event], gid: _GroupIds) -> _Verdict | None:
    sigs = {r: _signature(e, members, gid) for r, e in events.items()}
    if len(set(sigs.values())) > 1:
        expected, odd, tie = majority(sigs)
        return _Verdict("mismatch", _differing(sigs, COMPARED_FIELDS, expected, odd), tuple(odd), tie, expected)
    # Same signature, different metric/module: the backend pairs them silently. Only the label counts:
    # the same label reached from different lines (if rank == 0: broadcast(a) else: broadcast(b)) is ordinary code.
    labels = {r: e.label for r, e in events.items()}
    if len(set(labels.values())) > 1:
        expected, odd, tie = majority(labels)
        return _Verdict("order", ("label",), tuple(odd), tie, expected)
    return None


def _build(v: _Verdict, group: str, members: tuple[int, ...], seq: int, events: Mapping[int, Event],
           gid: _GroupIds) -> Finding:
    role = lambda r: "tie" if v.tie else ("odd" if r in v.odd else "majority")  # noqa: E731
    details = tuple(_detail(r, role(r), e) for r, e in sorted(events.items()))
    if v.kind == "order":
        return _crossing_finding(v, group, seq, events, details)
    ref = None if v.tie else next(e for _, e in sorted(events.items()) if _signature(e, members, gid) == v.expected)
    op, label, callsite = (ref.op, ref.label, ref.callsite) if ref else _common(events.values())
    return Finding(
        kind="mismatch", severity="error", group=group, seq=seq, op=op,
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


def _values_by_field(fields: Sequence[str], events: Mapping[int, Event], members: tuple[int, ...]) -> dict[str, dict[str, list[int]]]:
    """{field: {value as text: ranks}} — both sides of every difference, for people and tools."""
    out: dict[str, dict[str, list[int]]] = {}
    for f in fields:
        by_value: dict[str, list[int]] = defaultdict(list)
        for r, e in sorted(events.items()):
            by_value[field_value(f, _value(e, f, members))].append(r)
        out[f] = dict(by_value)
    return out


def _mismatch_summary(seq: int, group: str, members: tuple[int, ...], fields: tuple[str, ...],
                      events: Mapping[int, Event], ref: Event | None, odd: list[int]) -> str:
    values = _values_by_field(fields, events, members)
    diffs = "; ".join(f"{f} " + " vs ".join(f"{v} on {rank_list(rs)}" for v, rs in by.items())
                      for f, by in values.items())
    ops = "/".join(dict.fromkeys(e.op for _, e in sorted(events.items())))
    consequence = "; ".join(CONSEQUENCE[f] for f in fields)
    if ref is None:
        calls = "; ".join(f"{rank_list([r])} {_who(e)}" for r, e in sorted(events.items()))
        return (f"{ops} #{seq} (group {group}): the ranks disagree on {' and '.join(fields)} and no side has a "
                f"majority (a tie) — {diffs}. Calls: {calls}. Consequence: {consequence}.")
    odd_e = events[odd[0]]
    return (f"{ops} #{seq} (group {group}): {rank_list(odd)} called it with a different {' and '.join(fields)} "
            f"than the majority — {diffs}. Majority: {_who(ref)}; {rank_list(odd)}: {_who(odd_e)}. "
            f"Consequence: {consequence}.")


def _p2p_mismatch_at(group: str, seq: int, events: Mapping[int, Event]) -> Finding | None:
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
        kind="mismatch", severity="error", group=group, seq=seq, op=send.op, label=send.label,
        callsite=send.callsite, fields=fields, tie=True,
        ranks=(_detail(src, "sender", send), _detail(dst, "receiver", recv)),
        data={"values": _values_by_field(fields, events, ())},
        summary=(f"{send.op} #{seq} from rank {src} to rank {dst}: the buffers differ — {diffs}. "
                 f"Sender {_who(send)}; receiver {_who(recv)}. Consequence: "
                 + "; ".join(CONSEQUENCE[f] for f in fields) + "."),
    )


def _crossing_finding(v: _Verdict, group: str, seq: int, events: Mapping[int, Event],
                      details: tuple[RankDetail, ...]) -> Finding:
    by_label: dict[str, list[int]] = defaultdict(list)
    for r, e in sorted(events.items()):
        by_label[e.label or "(no module)"].append(r)
    sides = " meets ".join(f"{label} on {rank_list(rs)}" for label, rs in by_label.items())
    sample = events[min(events)]
    ref = None if v.tie else next(e for _, e in sorted(events.items()) if e.label == v.expected)
    summary = (f"Crossed calls at {sample.op} #{seq} (group {group}): {sides}. The signatures match, so the "
               f"backend pairs them without any error and the values are exchanged between different "
               f"metrics/modules" + (" (a tie: no side has a majority)" if v.tie else "")
               + ". Call them in the same order on every rank.")
    return Finding(
        kind="order", severity="error", summary=summary, group=group, seq=seq, op=sample.op,
        label=ref.label if ref else None, callsite=ref.callsite if ref else None,
        odd_ranks=v.odd, fields=("label",), tie=v.tie,
        majority=ref.fingerprint() | {"label": ref.label} if ref else None, ranks=details,
        data={"labels": dict(by_label)},
    )


# -- hangs ------------------------------------------------------------------------


def _whereabouts(rank: int, outcome: RankOutcome | None, last: Event | None = None) -> str:
    if outcome is None:
        return f"no status; its trace ends after {_call(last)}" if last else "never started"
    if outcome.state == "finished":
        return "finished, now idle"
    if outcome.state == "crashed":
        cause = outcome.exception or (f"killed by {outcome.signal}" if outcome.signal else f"exit code {outcome.exit_code}")
        return f"crashed ({cause})"
    if outcome.state == "stuck" and outcome.last_event is not None:
        e = outcome.last_event
        return f"waiting in {_call(e)} {_who(e)}"
    if outcome.phase == "starting":
        return "still starting up (init_process_group)"
    if outcome.where:
        return f"running outside any collective at {site(outcome.where)}"
    return outcome.state


def _reached(seqs: Mapping[int, Mapping[int, Event]], members: tuple[int, ...]) -> dict[int, int]:
    """The highest sequence number each member entered (0: none)."""
    reached = dict.fromkeys(members, 0)
    for seq, events in seqs.items():
        for r in events:
            if seq > reached.get(r, 0):
                reached[r] = seq
    return reached


def find_hangs(table: Table, outcomes: Mapping[int, RankOutcome], facts: RunFacts,
               mismatches: Sequence[Finding] = ()) -> list[Finding]:
    if facts.end_reason not in ABNORMAL_ENDS:
        return []
    detected_after = None
    if facts.stall_onset is not None and facts.detected_at is not None:
        detected_after = round(facts.detected_at - facts.stall_onset, 3)
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if len(members) < 2:
            continue
        reached = _reached(seqs, members)
        if len(set(reached.values())) > 1:
            seq = min(reached.values()) + 1
        else:
            seq = max(reached.values())
            if all(e.completed for e in seqs.get(seq, {}).values()):
                continue
        present = seqs.get(seq, {})
        if not present:
            continue
        absent = sorted(m for m in members if m not in present)
        last = {r: seqs[reached[r]][r] for r in absent if reached[r]}
        cause = next((m for m in mismatches if (m.group, m.seq) == (group, seq)), None)
        findings.append(_hang_finding(group, seq, present, absent, outcomes, last, cause, detected_after))
    return findings


def _hang_finding(group: str, seq: int, present: Mapping[int, Event], absent: list[int],
                  outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event], cause: Finding | None,
                  detected_after: float | None) -> Finding:
    waiting = sorted(present)
    op = Counter(e.op for e in present.values()).most_common(1)[0][0]
    ref = next(e for _, e in sorted(present.items()) if e.op == op)
    where = {r: _whereabouts(r, outcomes.get(r), last.get(r)) for r in absent}
    details = [_detail(r, "waiting", present[r], state=outcomes[r].state if r in outcomes else None) for r in waiting]
    details += [RankDetail(rank=r, role="absent", state=outcomes[r].state if r in outcomes else None,
                           where=outcomes[r].where if r in outcomes else None, note=where[r]) for r in absent]
    verb = "is" if len(waiting) == 1 else "are"
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    summary = f"{rank_list(waiting).capitalize()} {verb} waiting in {op} #{seq} (group {group}) {called}"
    if absent:
        groups: dict[str, list[int]] = defaultdict(list)
        for r in absent:
            groups[where[r]].append(r)
        summary += "; " + "; ".join(f"{rank_list(rs)} never entered it ({w})" for w, rs in groups.items())
        summary += ". Every rank must issue the same collectives in the same order: call it on all ranks."
    elif cause is not None:
        summary += (f"; every rank entered it but it never completed, most likely because of the "
                    f"{' and '.join(cause.fields)} mismatch in this very call (see the mismatch finding).")
    else:
        summary += "; every rank entered it but it never completed (a mismatch or a backend/network fault)."
    return Finding(
        kind="hang", severity="error", summary=summary, group=group, seq=seq, op=op, label=ref.label,
        callsite=ref.callsite, waiting_ranks=tuple(waiting), absent_ranks=tuple(absent),
        detected_after_s=detected_after, ranks=tuple(details),
        data={"caused_by": {"kind": cause.kind, "group": group, "seq": seq}} if cause else {},
    )


def find_startup_hang(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    if facts.end_reason not in ("stall", "timeout"):
        return []
    starting = sorted(r for r in range(facts.world_size)
                      if r not in outcomes or outcomes[r].phase in (None, "starting"))
    if not starting:
        return []
    ready = sorted(set(range(facts.world_size)) - set(starting))
    return [Finding(
        kind="hang", severity="error", op="init_process_group", waiting_ranks=tuple(ready),
        absent_ranks=tuple(starting),
        summary=(f"{rank_list(starting).capitalize()} never finished start-up (importing or init_process_group); "
                 f"{rank_list(ready)} got past it. Check that every rank can reach the rendezvous endpoint."),
        ranks=tuple(RankDetail(rank=r, role="absent", note=_whereabouts(r, outcomes.get(r))) for r in starting),
    )]


def find_timeout(outcomes: Mapping[int, RankOutcome], facts: RunFacts, already: list[Finding]) -> list[Finding]:
    if facts.end_reason != "timeout" or already:
        return []
    running = sorted(r for r, o in outcomes.items() if o.state in ("running", "stuck", "killed"))
    limit = f" of {facts.timeout_s:g} s" if facts.timeout_s else ""
    return [Finding(
        kind="hang", severity="error", waiting_ranks=tuple(running),
        summary=(f"The run did not finish within its --timeout{limit}: "
                 + "; ".join(f"rank {r} {_whereabouts(r, outcomes[r])}" for r in running) + "."),
        ranks=tuple(RankDetail(rank=r, role="running", where=outcomes[r].where,
                               note=_whereabouts(r, outcomes[r])) for r in running),
    )]


# -- crashes --------------------------------------------------------------------------


def _cause_text(o: RankOutcome) -> str:
    if o.exception:
        return f"raised {o.exception}"
    if o.signal:
        return f"was killed by {o.signal}"
    return f"exited with code {o.exit_code}"


def _inside(o: RankOutcome) -> Event | None:
    """The collective a rank died in: its last one, when that never returned or returned an error."""
    e = o.last_event
    return e if e is not None and (e.t_exit is None or e.error) else None


def find_crashes(outcomes: Mapping[int, RankOutcome], facts: RunFacts,
                 mismatches: Sequence[Finding] = ()) -> list[Finding]:
    """The root-cause crash (outcomes already tell primary failures from their consequences)."""
    crashed = [o for _, o in sorted(outcomes.items()) if o.state == "crashed"]
    if not crashed:
        return []
    # A Python exception is the clearest root cause; then signals; then bare exit codes.
    root = sorted(crashed, key=lambda o: (o.exception is None, o.signal is None, o.rank))[0]
    inside = _inside(root)
    cause = next((m for m in mismatches if inside and (m.group, m.seq) == (inside.group, inside.seq)), None)
    peers = sorted(r for r, o in outcomes.items() if o.state != "crashed")
    details = [RankDetail(rank=o.rank, role="crashed", state=o.state, where=o.where,
                          op=_inside(o).op if _inside(o) else None, seq=_inside(o).seq if _inside(o) else None,
                          note=o.exception or o.signal or f"exit code {o.exit_code}") for o in crashed]
    details += [RankDetail(rank=r, role="peer", state=outcomes[r].state, where=outcomes[r].where,
                           note=_whereabouts(r, outcomes[r])) for r in peers]
    last = inside or root.last_event
    data = {"root_rank": root.rank, "exception": root.exception, "signal": root.signal, "exit_code": root.exit_code}
    if root.signal == "SIGKILL":
        data.update(oom_kills=facts.oom_kills, rss_bytes=root.rss_bytes, peak_rss_bytes=root.peak_rss_bytes)
    if cause is not None:
        data["caused_by"] = {"kind": cause.kind, "group": cause.group, "seq": cause.seq, "fields": list(cause.fields)}
    return [Finding(
        kind="crash", severity="error",
        summary=_crash_summary(root, inside, cause, crashed, outcomes) + _sigkill_note(root, facts),
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        label=last.label if last else None, callsite=root.where or (inside.callsite if inside else None),
        odd_ranks=(root.rank,), ranks=tuple(details), data=data,
    )]


def _crash_summary(root: RankOutcome, inside: Event | None, cause: Finding | None,
                   crashed: Sequence[RankOutcome], outcomes: Mapping[int, RankOutcome]) -> str:
    summary = f"Rank {root.rank} {_cause_text(root)}"
    if inside is not None:
        summary += f" inside {_call(inside)}"
    where = root.where or (inside.callsite if inside else None)
    if where:
        summary += f" at {site(where)}"
    if cause is not None:
        summary += (f" — most likely a consequence of the {' and '.join(cause.fields)} mismatch in that very "
                    f"collective (see the mismatch finding)")
        if {"shape", "dtype"} & set(cause.fields):
            summary += ": gloo aborts a process that receives a buffer of another size than it expects"
    same = [o.rank for o in crashed if o.rank != root.rank and _cause_text(o) == _cause_text(root)]
    if same:
        summary += f"; {rank_list(same)} failed the same way"
    summary += "".join(f"; rank {o.rank} {_cause_text(o)}" for o in crashed
                       if o.rank != root.rank and o.rank not in same)
    groups: dict[str, list[int]] = defaultdict(list)
    for r, o in sorted(outcomes.items()):
        if o.state != "crashed":
            groups[_whereabouts(r, o)].append(r)
    if groups:
        summary += "; meanwhile " + "; ".join(f"{rank_list(rs)} {w}" for w, rs in groups.items())
    return summary + "."


def _sigkill_note(o: RankOutcome, facts: RunFacts) -> str:
    """Who sent a SIGKILL that distcheck did not send: the OOM killer, as far as the facts say."""
    if o.signal != "SIGKILL":
        return ""
    used = ""
    if o.rss_bytes is not None:
        used = f"; rank {o.rank} was last seen using {gib(o.rss_bytes)} resident"
        if o.peak_rss_bytes and o.peak_rss_bytes > o.rss_bytes:
            used += f" (peak {gib(o.peak_rss_bytes)})"
    if facts.oom_kills:
        return (f" The kernel's OOM killer sent that SIGKILL: the memory cgroup distcheck runs in counted "
                f"{plural(facts.oom_kills, 'OOM kill')} during the run{used}.")
    if facts.oom_kills == 0:
        return (f" distcheck did not send that SIGKILL, and the memory cgroup it runs in counted no OOM kill during "
                f"the run: it came from elsewhere (a scheduler, an operator, another cgroup's OOM killer){used}.")
    return f" distcheck did not send that SIGKILL; the kernel's OOM killer is the usual sender (see dmesg){used}."


# -- counts ------------------------------------------------------------------------


def find_count_differences(table: Table, facts: RunFacts, explained: bool) -> list[Finding]:
    """Ranks of one group that issued different numbers of collectives by the end of a clean run."""
    if explained or facts.end_reason == "max_duration":
        return []
    findings = []
    for (group, members), seqs in sorted(table.items()):
        counts = Counter({m: 0 for m in members})
        for events in seqs.values():
            counts.update(events.keys())
        counts = {m: counts[m] for m in members}
        if len(set(counts.values())) <= 1:
            continue
        findings.append(_count_finding(group, seqs, counts))
    return findings


def _count_finding(group: str, seqs: Mapping[int, Mapping[int, Event]], counts: Mapping[int, int]) -> Finding:
    expected, odd, tie = majority(counts)
    fewest = min(counts.values())
    by_count: dict[int, list[int]] = defaultdict(list)
    for r, c in sorted(counts.items()):
        by_count[c].append(r)
    role = lambda r: "tie" if tie else ("odd" if r in odd else "majority")  # noqa: E731
    # Each rank's first call beyond what every rank issued, or its last call: the lines to look at.
    details = []
    for r in sorted(counts):
        e = seqs.get(fewest + 1, {}).get(r) or (seqs.get(counts[r], {}).get(r) if counts[r] else None)
        details.append(_detail(r, role(r), e, note=f"issued {counts[r]}"))
    extra = [d for d in details if d.seq is not None and d.seq > fewest]
    sides = ", ".join(f"{rank_list(rs)} issued {c}" for c, rs in sorted(by_count.items()))
    summary = f"Ranks issued different numbers of collectives on group {group}: {sides}"
    if extra:
        d = extra[0]
        summary += f"; the first extra call is {d.op} #{d.seq} {d.label + ' ' if d.label else ''}at {site(d.callsite)}"
    return Finding(
        kind="count", severity="error", group=group, odd_ranks=tuple(odd), tie=tie, fields=("count",),
        majority={"count": expected} if not tie else None, summary=summary + ".", ranks=tuple(details),
        data={"counts": {str(r): c for r, c in sorted(counts.items())}},
    )


# -- wrong numbers ------------------------------------------------------------


def find_numeric(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    """A distributed result that differs from its single-process reference, entry by entry."""
    by_name: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for check in res.get("numeric_checks", ()):
            by_name[check["name"]][rank] = check
    findings = []
    for name, checks in by_name.items():
        bad = {r: c for r, c in checks.items() if not c["ok"]}
        if bad:
            findings.append(_numeric_finding(name, bad))
    return findings


def _numeric_finding(name: str, bad: Mapping[int, Mapping[str, Any]]) -> Finding:
    first = bad[min(bad)]
    differing = first["differing"]
    n = first.get("n_differing") or len(differing)   # older results list every entry they know
    total = math.prod(first["shape"]) if first["shape"] else 1
    if first["shape"] and differing and differing[0]["index"] is None:   # the shapes themselves differ
        what = f"its shape is {differing[0]['actual']} instead of {differing[0]['reference']}"
    else:
        shown = "; ".join(_entry(d) for d in differing[:8]) + ("; ..." if n > 8 else "")
        what = (f"{plural(n, 'entry', 'entries')} of {total} off (max |diff| {_num(first['max_abs_diff'])}): {shown}"
                if total > 1 else f"{_num(differing[0]['actual'])} instead of {_num(differing[0]['reference'])}")
    summary = f"{name!r} differs from the single-process reference on {rank_list(bad)}: {what}."
    totals = _totals(first.get("actual"), first.get("reference"))
    if totals:
        summary += f" {totals}"
    if first.get("note"):
        summary += f" {first['note']}"
    return Finding(
        kind="numeric", severity="error", summary=summary, odd_ranks=tuple(sorted(bad)),
        data={"check": name, "ranks": sorted(bad), "max_abs_diff": first["max_abs_diff"], "shape": first["shape"],
              "differing": differing, "actual": first.get("actual"), "reference": first.get("reference")},
    )


def _entry(d: Mapping[str, Any]) -> str:
    diff = d["actual"] - d["reference"]
    return f"{_index(d['index'])} is {_num(d['actual'])} instead of {_num(d['reference'])} ({signed(diff)})"


def _totals(actual: Any, reference: Any) -> str:
    """For a matrix: which rows' sums are off, and whether the grand total still looks right."""
    if not (isinstance(actual, list) and actual and isinstance(actual[0], list)):
        return ""
    rows_a, rows_r = [sum(row) for row in actual], [sum(row) for row in reference]
    off = [i for i, (a, r) in enumerate(zip(rows_a, rows_r)) if a != r]
    if not off:
        return ""
    rows = ", ".join(f"row {i} sums to {_num(rows_a[i])} instead of {_num(rows_r[i])}" for i in off)
    total_a, total_r = sum(rows_a), sum(rows_r)
    total = (f"the grand total {_num(total_a)} is right" if total_a == total_r
             else f"the grand total is {_num(total_a)} instead of {_num(total_r)}")
    return f"By row: {rows}; {total}."


def _index(idx: Any) -> str:
    if idx in (None, []):
        return "value"
    return "[" + ", ".join(map(str, idx)) + "]"


def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def find_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int) -> list[Finding]:
    """Samples counted more than once or never, per dataset, with the likely cause in plain words."""
    per_dataset: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, int] = {}
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            per_dataset[rec["dataset"]][rank].extend(rec["ids"])
            sizes[rec["dataset"]] = rec["dataset_size"]
    findings = []
    for dataset, by_rank in per_dataset.items():
        f = _sample_finding(dataset, sizes[dataset], by_rank, world_size)
        if f is not None:
            findings.append(f)
    return findings


def sample_accounting(size: int, by_rank: Mapping[int, Sequence[int]]) -> dict[str, Any]:
    counts = Counter(i for ids in by_rank.values() for i in ids)
    seen_by: dict[int, list[int]] = defaultdict(list)
    for r, ids in sorted(by_rank.items()):
        for i in ids:
            seen_by[i].append(r)
    duplicated = {i: seen_by[i] for i, c in sorted(counts.items()) if c > 1}
    missing = sorted(set(range(size)) - set(counts))
    return {"counts": counts, "duplicated": duplicated, "missing": missing, "total": sum(counts.values())}


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(n, f"{n} times")


def _sample_cause(size: int, by_rank: Mapping[int, Sequence[int]], world_size: int,
                  acc: Mapping[str, Any]) -> tuple[str, str]:
    """(why samples were duplicated or missed, what to do about it), in plain words."""
    ranks = sorted(by_rank)
    duplicated, missing, total = acc["duplicated"], acc["missing"], acc["total"]
    if world_size > 1 and len(ranks) == world_size and len({tuple(sorted(by_rank[r])) for r in ranks}) == 1:
        seen = sorted(by_rank[ranks[0]])
        return (f"every rank evaluated the same {plural(len(seen), 'sample')} (ids {id_list(seen)}): the data is "
                f"not sharded across the {world_size} ranks",
                "shard it with a DistributedSampler (Lightning: keep use_distributed_sampler=True)")
    padded_to = math.ceil(size / world_size) * world_size
    if duplicated and not missing and total == padded_to and padded_to > size:
        return (f"DistributedSampler padded {size} samples to {padded_to} for {world_size} ranks by repeating "
                f"{plural(padded_to - size, 'sample')}",
                "shard evaluation data without padding (an unrepeated sampler), or use drop_last=True where "
                "losing samples is acceptable")
    if missing and not duplicated and total == (size // world_size) * world_size:
        return (f"DistributedSampler(drop_last=True) dropped {plural(len(missing), 'sample')} so that "
                f"{world_size} ranks get equal shards", "evaluate with an unrepeated sampler instead")
    if duplicated:
        return "the ranks' shards overlap", "give every rank a disjoint shard"
    return "the ranks' shards do not cover the dataset", "make the shards cover every sample"


def _sample_finding(dataset: str, size: int, by_rank: Mapping[int, Sequence[int]], world_size: int) -> Finding | None:
    acc = sample_accounting(size, by_rank)
    duplicated, missing = acc["duplicated"], acc["missing"]
    if not duplicated and not missing:
        return None
    cause, fix = _sample_cause(size, by_rank, world_size, acc)
    counted = _how_counted(duplicated, missing)
    shown = ", ".join(f"id {i} (ranks {', '.join(map(str, rs))})" for i, rs in list(duplicated.items())[:10])
    same_everywhere = cause.startswith("every rank evaluated")
    # Who saw which duplicate — unless it is "everyone saw everything", which the cause already says.
    detail = f" — {shown}" + (", ..." if len(duplicated) > 10 else "") if duplicated and not same_everywhere else ""
    summary = f"Dataset {dataset!r} ({plural(size, 'sample')}): {counted}{detail}; because {cause}. Fix: {fix}."
    extra = acc["total"] - (size - len(missing))
    return Finding(
        kind="duplicates", severity="error", summary=summary,
        odd_ranks=tuple(sorted({r for rs in duplicated.values() for r in rs})),
        data={"dataset": dataset, "dataset_size": size, "duplicated": {str(i): rs for i, rs in duplicated.items()},
              "missing": missing, "extra": extra, "cause": cause, "counted": counted,
              "same_on_every_rank": same_everywhere,
              "per_rank": {str(r): sorted(ids) for r, ids in sorted(by_rank.items())}},
    )


def _ids(ids: Iterable[int]) -> str:
    ids = list(ids)
    return f"id {ids[0]}" if len(ids) == 1 else f"ids {id_list(ids)}"


def _how_counted(duplicated: Mapping[int, list[int]], missing: Sequence[int]) -> str:
    """'samples 0, 1 were counted twice and 24 samples (ids 8-31) were never seen'."""
    parts = []
    if duplicated:
        most = max(len(rs) for rs in duplicated.values())
        how = _times(most) if all(len(rs) == most for rs in duplicated.values()) else "more than once"
        n = len(duplicated)
        parts.append(f"{plural(n, 'sample')} ({_ids(duplicated)}) {'was' if n == 1 else 'were'} counted {how}")
    if missing:
        n = len(missing)
        parts.append(f"{plural(n, 'sample')} ({_ids(missing)}) {'was' if n == 1 else 'were'} never seen")
    return " and ".join(parts)


def explain_numbers(numeric: list[Finding], duplicates: Sequence[Finding], crossings: Sequence[Finding] = ()) -> list[Finding]:
    """A wrong number next to duplicated/missing samples or crossed calls: name them as the likely reason."""
    reasons = []
    if duplicates:
        d = duplicates[0].data
        reasons.append(f"{d['counted']}, because {d['cause']} (see the duplicates finding)")
    if crossings:
        c = crossings[0]
        reasons.append(f"collectives of different metrics/modules were crossed from {c.op} #{c.seq} "
                       f"(group {c.group}) onwards (see the order finding)")
    if not numeric or not reasons:
        return numeric
    why = f" Likely reason: {'; and '.join(reasons)}."
    return [dataclasses.replace(f, summary=f.summary + why) for f in numeric]


# -- stragglers --------------------------------------------------------------


def find_stragglers(table: Table, facts: RunFacts, min_collectives: int = 5, share: float = 0.8) -> list[Finding]:
    """A rank that is the last one into most collectives, by a lag well above scheduling noise."""
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if group.startswith("p2p:") or len(members) < 2:
            continue
        lags: dict[int, list[float]] = defaultdict(list)
        last_count: Counter = Counter()
        complete = [events for events in seqs.values() if len(events) == len(members)]
        for events in complete:
            first = min(e.t_enter for e in events.values())
            last_count[max(events, key=lambda r: events[r].t_enter)] += 1
            for r, e in events.items():
                lags[r].append(e.t_enter - first)
        if len(complete) < min_collectives:
            continue
        for rank, n_last in sorted(last_count.items()):
            median_lag = statistics.median(lags[rank])
            if n_last >= share * len(complete) and median_lag >= facts.straggler_min_lag_s:
                findings.append(_straggler_finding(group, rank, n_last, len(complete), lags))
    return findings


def _straggler_finding(group: str, rank: int, n_last: int, complete: int, lags: Mapping[int, list[float]]) -> Finding:
    median_lag = statistics.median(lags[rank])
    others = statistics.median(lag for r, ls in lags.items() if r != rank for lag in ls)
    return Finding(
        kind="straggler", severity="warning", group=group, odd_ranks=(rank,),
        summary=(f"Rank {rank} was the last to enter {n_last} of {complete} collectives on group {group}, a median "
                 f"{median_lag:.3f} s after the first rank (max {max(lags[rank]):.3f} s); every other rank waits "
                 f"for it each time. Look for extra work on that rank (data loading, logging, rank-specific code)."),
        data={"rank": rank, "last_in": n_last, "collectives": complete, "median_lag_s": round(median_lag, 4),
              "max_lag_s": round(max(lags[rank]), 4), "others_median_lag_s": round(others, 4)},
    )


# -- entry point ----------------------------------------------------------------


def analyze(
    traces: Mapping[int, Sequence[Event]],
    outcomes: Mapping[int, RankOutcome],
    facts: RunFacts,
    results: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Every finding for one run, most important first.

    A crash or hang that a mismatch explains comes after that mismatch: the
    mismatch is the root cause, the dead or stuck rank its consequence.
    """
    table = group_table(traces)
    mismatches = find_mismatches(table)
    crashes = find_crashes(outcomes, facts, mismatches)
    hangs = [] if crashes else find_hangs(table, outcomes, facts, mismatches)
    hangs = hangs or ([] if crashes else find_startup_hang(outcomes, facts))
    counts = find_count_differences(table, facts, explained=bool(crashes or hangs or facts.end_reason in ABNORMAL_ENDS))
    timeout = find_timeout(outcomes, facts, crashes + hangs)
    results = results or {}
    duplicates = find_duplicates(results, facts.world_size)
    numeric = explain_numbers(find_numeric(results), duplicates, [m for m in mismatches if m.kind == "order"])
    stopped = crashes + hangs + timeout
    caused = [f for f in stopped if "caused_by" in f.data]
    first = [f for f in stopped if f not in caused]
    return first + mismatches + caused + counts + numeric + duplicates + find_stragglers(table, facts)


def collectives_compared(traces: Mapping[int, Sequence[Event]]) -> int:
    """How many (group, seq) calls were seen on at least two ranks and compared."""
    table = group_table(traces)
    return sum(1 for seqs in table.values() for events in seqs.values() if len(events) >= 2)


def observed_kinds(findings: Iterable[Finding]) -> tuple[str, ...]:
    kinds = sorted({f.kind for f in findings if f.severity in ("error", "warning")})
    return tuple(kinds) or ("pass",)


def behaved_as_expected(expected: Sequence[str], observed: Sequence[str]) -> bool:
    """'pass' must see no finding at all; otherwise every expected kind must be observed.

    Extra kinds are allowed: a mismatch that makes gloo abort a rank also shows
    as a crash, a hang can leave ranks with different counts.
    """
    if tuple(expected) == ("pass",):
        return tuple(observed) == ("pass",)
    return set(expected) <= set(observed)
