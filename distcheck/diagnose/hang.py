"""Hangs: ranks waiting in a (group, seq) that others never entered or that
never completed; ranks that never got past start-up; a run past its --timeout. Pure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Mapping, Sequence

from distcheck.diagnose.common import ABNORMAL_ENDS, RunFacts, Table, detail, whereabouts
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
    where = {r: whereabouts(r, outcomes.get(r), last.get(r)) for r in absent}
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
    if facts.end_reason not in (EndReason.STALL, EndReason.TIMEOUT):
        return []
    starting = sorted(r for r in range(facts.world_size)
                      if r not in outcomes or outcomes[r].phase in (None, Phase.STARTING))
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


def find_timeout(outcomes: Mapping[int, RankOutcome], facts: RunFacts, already: list[Finding]) -> list[Finding]:
    if facts.end_reason != EndReason.TIMEOUT or already:
        return []
    running = sorted(r for r, o in outcomes.items() if o.state in (RankState.RUNNING, RankState.STUCK, RankState.KILLED))
    limit = f" of {facts.timeout_s:g} s" if facts.timeout_s else ""
    return [Finding(
        kind="hang", severity="error", waiting_ranks=tuple(running),
        summary=(f"The run did not finish within its --timeout{limit}: "
                 + "; ".join(f"rank {r} {whereabouts(r, outcomes[r])}" for r in running) + "."),
        ranks=tuple(RankDetail(rank=r, role="running", where=outcomes[r].where,
                               note=whereabouts(r, outcomes[r])) for r in running),
    )]
