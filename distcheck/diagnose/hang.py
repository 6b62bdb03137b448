"""Hangs: ranks waiting in a (group, seq) that others never entered or that
never completed; ranks that never got past start-up; a run past its --timeout. Pure.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Mapping, Sequence

from distcheck.diagnose.common import ABNORMAL_ENDS, RunFacts, Table, detail, whereabouts, who
from distcheck.knowledge.library_shapes import waits_elsewhere
from distcheck.models import EndReason, Event, Finding, Phase, RankDetail, RankOutcome, RankState
from distcheck.text import rank_list, site


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
        if set(absent) <= set(facts.records_lost) and all(e.completed for e in present.values()):
            continue   # they returned, so the absent entered it: only their records are missing (a lost node)
        last = {r: seqs[reached[r]][r] for r in absent if reached[r]}
        split = waits_elsewhere(present)
        if split is not None:   # a barrier on one side, a data call on the other: each waits in its own
            findings.append(_elsewhere_finding(group, seq, *split, absent, outcomes, last, detected_after))
            continue
        cause = next((m for m in mismatches if (m.group, m.seq) == (group, seq)), None)
        findings.append(_hang_finding(group, seq, present, absent, outcomes, last, cause, detected_after,
                                      facts.records_lost))
    findings = merge_cycles(findings)
    if facts.evidence:
        findings = [dataclasses.replace(f, summary=f"{f.summary} Decided: {facts.evidence}.",
                                        data={**f.data, "evidence": facts.evidence}) for f in findings]
    return findings


def merge_cycles(findings: list[Finding]) -> list[Finding]:
    """Hangs that wait for each other are one hang: rank 0 in send to 1 while rank 1 is in send to 0
    (each alone reads "the other never entered it", and the advice "call it on all ranks" is wrong).
    Only where no side is outnumbered: 1 rank against 3 is still the odd one out, said by majority."""
    in_hang = {r: i for i, f in enumerate(findings) for r in f.waiting_ranks}
    edges = {i: {in_hang[a] for a in f.absent_ranks if a in in_hang} for i, f in enumerate(findings)}
    merged, done = [], set()
    for i in range(len(findings)):
        if i in done:
            continue
        cycle = _cycle_through(i, edges)
        if len(cycle) < 2 or not all(_symmetric(findings[j]) for j in cycle):
            continue   # one side outnumbered: "the odd one out" (majority) says more than "a cycle"
        done |= cycle
        merged.append(_cycle_finding([findings[j] for j in sorted(cycle)]))
    return merged + [f for i, f in enumerate(findings) if i not in done]


def _symmetric(f: Finding) -> bool:
    """A part of a cycle with no majority to blame: a P2P call, or as many ranks waiting as absent."""
    return bool(f.group and f.group.startswith("p2p:")) or len(f.waiting_ranks) == len(f.absent_ranks)


def _cycle_through(start: int, edges: Mapping[int, set[int]]) -> set[int]:
    """The findings on a cycle of waits through ``start`` (empty when there is none)."""
    path, seen = [start], {start}

    def walk(node: int) -> set[int] | None:
        for nxt in sorted(edges[node]):
            if nxt == start:
                return set(path)
            if nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                found = walk(nxt)
                if found:
                    return found
                path.pop()
        return None

    return walk(start) or set()


def _cycle_finding(parts: list[Finding]) -> Finding:
    waiting = tuple(sorted(r for f in parts for r in f.waiting_ranks))
    where = "; ".join(f"{rank_list(f.waiting_ranks)} in {f.op} #{f.seq} ({_group_words(f.group)}) at {site(f.callsite)}"
                      for f in parts)
    p2p = all(f.group and f.group.startswith("p2p:") for f in parts)
    advice = ("Order the pair (even ranks send first, odd ranks receive first), or post both with "
              "batch_isend_irecv / isend + irecv." if p2p and all(f.op == "send" for f in parts) else
              "Every rank must enter these groups' collectives in the same order.")
    return Finding(
        kind="hang", severity="error", group=parts[0].group, seq=parts[0].seq, op=parts[0].op, label=parts[0].label,
        callsite=parts[0].callsite, waiting_ranks=waiting, absent_ranks=(),
        detected_after_s=parts[0].detected_after_s,
        summary=f"{rank_list(waiting).capitalize()} wait for each other (a cycle; none can finish first): {where}. {advice}",
        ranks=tuple(dataclasses.replace(d, role="waiting") for f in parts for d in f.ranks if d.role == "waiting"),
        data={"cycle": [{"group": f.group, "seq": f.seq, "op": f.op, "ranks": list(f.waiting_ranks),
                         "callsite": f.callsite} for f in parts]},
    )


def _group_words(group: str | None) -> str:
    if group and group.startswith("p2p:"):
        src, _, dst = group[4:].partition(">")
        return f"from rank {src} to rank {dst}"
    return f"group {group}"


_LOST = "their records went with their lost node"


def _elsewhere_finding(group: str, seq: int, sync: Mapping[int, Event], others: Mapping[int, Event],
                       absent: list[int], outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event],
                       detected_after: float | None) -> Finding:
    """Ranks waiting in a barrier while their peers wait, at the same number, in a call that moves data:
    the ones in the barrier arrived; the others never entered it, each stuck at its own line."""
    found = _hang_finding(group, seq, sync, absent, outcomes, last, None, detected_after)
    elsewhere = {r: f"waiting in {e.op} #{e.seq} {who(e)}" for r, e in sorted(others.items())}
    by_where: dict[str, list[int]] = defaultdict(list)
    for r, text in elsewhere.items():
        by_where[text].append(r)
    ref = next(iter(sorted(sync.items())))[1]
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    verb = "is" if len(sync) == 1 else "are"
    summary = (f"{rank_list(sorted(sync)).capitalize()} {verb} waiting in {ref.op} #{seq} (group {group}) {called}; "
               + "; ".join(f"{rank_list(rs)} never entered it ({w})" for w, rs in by_where.items())
               + (f"; {rank_list(absent)} never entered it" if absent else "")
               + ". The ranks took different paths: each side waits in its own call and neither can finish. "
                 "Every rank must reach the barrier after the same collectives (the same number of steps).")
    details = tuple(d for d in found.ranks if d.role == "waiting") + tuple(
        detail(r, "absent", e, state=outcomes[r].state if r in outcomes else None, note=elsewhere[r])
        for r, e in sorted(others.items())) + tuple(d for d in found.ranks if d.role == "absent")
    return dataclasses.replace(found, summary=summary, absent_ranks=tuple(sorted([*others, *absent])), ranks=details,
                               data={**found.data, "elsewhere": {str(r): {"op": e.op, "callsite": e.callsite,
                                                                          "label": e.label}
                                                                 for r, e in sorted(others.items())}})


def _hang_finding(group: str, seq: int, present: Mapping[int, Event], absent: list[int],
                  outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event], cause: Finding | None,
                  detected_after: float | None, records_lost: tuple[int, ...] = ()) -> Finding:
    waiting = sorted(present)
    op = Counter(e.op for e in present.values()).most_common(1)[0][0]
    ref = next(e for _, e in sorted(present.items()) if e.op == op)
    where = {r: _LOST if r in records_lost else whereabouts(r, outcomes.get(r), last.get(r)) for r in absent}
    details = [detail(r, "waiting", present[r], state=outcomes[r].state if r in outcomes else None) for r in waiting]
    details += [RankDetail(rank=r, role="absent", state=outcomes[r].state if r in outcomes else None,
                           where=outcomes[r].where if r in outcomes else None, note=where[r]) for r in absent]
    verb = "is" if len(waiting) == 1 else "are"
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    summary = f"{rank_list(waiting).capitalize()} {verb} waiting in {op} #{seq} (group {group}) {called}"
    if absent:
        groups: dict[str, list[int]] = defaultdict(list)
        for r in absent:
            groups[where[r]].append(r)
        summary += "; " + "; ".join(f"{rank_list(rs)} never entered it ({w})" if w != _LOST else
                                    f"{rank_list(rs)}: not known ({w})" for w, rs in groups.items())
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
    if not EndReason.of(facts.end_reason).by_distcheck:
        return []
    starting = sorted(r for r in range(facts.world_size) if r not in facts.records_lost
                      and (r not in outcomes or outcomes[r].phase in (None, Phase.STARTING)))
    if not starting:
        return []
    ready = sorted(set(range(facts.world_size)) - set(starting))
    return [Finding(
        kind="hang", severity="error", op="init_process_group", waiting_ranks=tuple(ready),
        absent_ranks=tuple(starting),
        summary=(f"{rank_list(starting).capitalize()} never finished start-up (importing or init_process_group); "
                 f"{rank_list(ready)} got past it. Check that every rank can reach the rendezvous endpoint."),
        ranks=tuple(RankDetail(rank=r, role="absent", note=whereabouts(r, outcomes.get(r))) for r in starting),
    )]


# States of a rank that had not finished when the run was cut.
_UNFINISHED = (RankState.RUNNING, RankState.STUCK, RankState.KILLED)


def find_timeout(outcomes: Mapping[int, RankOutcome], facts: RunFacts, already: list[Finding]) -> list[Finding]:
    """What was left open when --timeout cut a run that no other hang finding explains.

    Only a rank inside a collective is *waiting*; the other members of that call are
    *absent* with their whereabouts (finished, or busy in user code), as a stall report
    says it. Unfinished ranks outside every open call are absent from nothing: they get
    one finding of their own, never a "waiting" role.
    """
    if facts.end_reason != EndReason.TIMEOUT or already:
        return []
    limit = f" of {facts.timeout_s:g} s" if facts.timeout_s else ""
    prefix = f"The run did not finish within its --timeout{limit}"
    findings = [_timed_out_in(call, present, facts.world_size, outcomes, prefix)
                for call, present in sorted(_open_calls(outcomes).items())]
    named = {r for f in findings for r in f.waiting_ranks + f.absent_ranks}
    rest = sorted(r for r, o in outcomes.items() if o.state in _UNFINISHED and r not in named)
    if rest or not findings:
        findings.append(_timed_out_outside(rest, outcomes, prefix))
    return findings


def _open_calls(outcomes: Mapping[int, RankOutcome]) -> dict[tuple[str, int], dict[int, Event]]:
    """{(group, seq): {rank: event}} of the collectives ranks were stuck in at the end."""
    calls: dict[tuple[str, int], dict[int, Event]] = defaultdict(dict)
    for r, o in sorted(outcomes.items()):
        if o.state == RankState.STUCK and o.last_event is not None:
            calls[(o.last_event.group, o.last_event.seq)][r] = o.last_event
    return calls


def _timed_out_in(call: tuple[str, int], present: Mapping[int, Event], world_size: int,
                  outcomes: Mapping[int, RankOutcome], prefix: str) -> Finding:
    """The stall report's hang finding for one open call, said as a timeout."""
    group, seq = call
    members = next(iter(present.values())).group_ranks or tuple(range(world_size))
    absent = sorted(set(members) - set(present))
    found = _hang_finding(group, seq, present, absent, outcomes, {}, None, None)
    return dataclasses.replace(found, summary=f"{prefix}: {found.summary[0].lower()}{found.summary[1:]}")


def _timed_out_outside(rest: list[int], outcomes: Mapping[int, RankOutcome], prefix: str) -> Finding:
    """Unfinished ranks that were in no collective: busy in user code, so absent and not waiting."""
    done = sorted(r for r, o in outcomes.items() if o.state == RankState.FINISHED)
    parts = [f"rank {r} {whereabouts(r, outcomes[r])}" for r in rest]
    parts += [f"{rank_list(done)} finished"] if done else []
    said = f": {'; '.join(parts)}" if parts else ""
    return Finding(
        kind="hang", severity="error", summary=f"{prefix} and no rank was waiting in a collective{said}.",
        absent_ranks=tuple(rest),
        ranks=tuple(RankDetail(rank=r, role="absent", state=outcomes[r].state, where=outcomes[r].where,
                               note=whereabouts(r, outcomes[r])) for r in rest),
    )
