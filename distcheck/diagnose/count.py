"""Count differences: ranks of one group that issued different numbers of
collectives by the end of a clean run. Pure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Mapping

from distcheck.diagnose.common import RunFacts, Table, detail, majority
from distcheck.models import EndReason, Event, Finding, RankOutcome, RankState
from distcheck.text import rank_list, site


def find_count_differences(table: Table, facts: RunFacts, explained: bool,
                           outcomes: Mapping[int, RankOutcome] | None = None) -> list[Finding]:
    """Ranks of one group that issued different numbers of collectives by the end of a clean run.

    A launch that completed, with every rank finished and back from every call it entered, cannot
    have issued different numbers: the group's counter numbers every call on every rank, and a
    collective returns only when all of its members entered it. Records that disagree there are
    distcheck's own loss, said as a ``coverage`` warning, never as the user's error.
    """
    if explained or facts.end_reason == EndReason.MAX_DURATION:
        return []
    findings = []
    whole = completed_cleanly(table, facts, outcomes)
    for (group, members), seqs in sorted(table.items()):
        counts = Counter({m: 0 for m in members})
        for events in seqs.values():
            counts.update(events.keys())
        counts = {m: counts[m] for m in members}
        if len(set(counts.values())) <= 1:
            continue
        # An async call returns before its peers join it: one no peer joined is the job's, not a lost record.
        partial = [e for events in seqs.values() if len(events) < len(members) for e in events.values()]
        lost = whole and not any(e.async_op for e in partial)
        findings.append(_lost_records(group, seqs, counts) if lost else _count_finding(group, seqs, counts))
    return findings


def completed_cleanly(table: Table, facts: RunFacts, outcomes: Mapping[int, RankOutcome] | None) -> bool:
    """The launch completed, every rank finished, and every call a rank entered returned."""
    if facts.end_reason != EndReason.COMPLETED or not outcomes:
        return False
    if any(o.state != RankState.FINISHED for o in outcomes.values()):
        return False
    return all(e.completed for seqs in table.values() for events in seqs.values() for e in events.values())


def _lost_records(group: str, seqs: Mapping[int, Mapping[int, Event]], counts: Mapping[int, int]) -> Finding:
    members = sorted(counts)
    missing = {r: [s for s, events in sorted(seqs.items()) if r not in events] for r in members}
    missing = {r: m for r, m in missing.items() if m}
    said = "; ".join(f"rank {r} lacks {_numbers(m)}" for r, m in missing.items())
    return Finding(
        kind="coverage", severity="warning", group=group, odd_ranks=tuple(missing),
        summary=(f"distcheck lost records on group {group}: the job completed and every rank returned from every "
                 f"call, so every rank issued the same collectives, but {said}. Those calls were not compared; "
                 f"this is distcheck's shortcoming, not your job's (please report it)."),
        data={"missing": {str(r): m for r, m in missing.items()}, "counts": {str(r): c for r, c in counts.items()}},
    )


def _numbers(seqs: list[int]) -> str:
    shown = ", ".join(f"#{s}" for s in seqs[:8])
    return shown + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")


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
        details.append(detail(r, role(r), e, note=f"issued {counts[r]}"))
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
