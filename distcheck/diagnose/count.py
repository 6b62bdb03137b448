"""Count differences: ranks of one group that issued different numbers of
collectives by the end of a clean run. Pure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Mapping

from distcheck.diagnose.common import RunFacts, Table, detail, majority
from distcheck.models import EndReason, Event, Finding
from distcheck.text import rank_list, site


def find_count_differences(table: Table, facts: RunFacts, explained: bool) -> list[Finding]:
    """Ranks of one group that issued different numbers of collectives by the end of a clean run."""
    if explained or facts.end_reason == EndReason.MAX_DURATION:
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
