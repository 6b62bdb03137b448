"""Stragglers: a rank that is the last one into most collectives, by a lag well
above scheduling noise; and a rank so late into one collective that the others
waited a whole stall timeout for it (busy in its own code: late, not hung). Pure.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping

from distcheck.diagnose.common import RunFacts, Table, detail
from distcheck.models import Event, Finding, GroupKey, Kind, RankOutcome, Severity
from distcheck.text import rank_list, site


def find_stragglers(table: Table, facts: RunFacts, min_collectives: int = 5, share: float = 0.8) -> list[Finding]:
    """A rank that is the last one into most collectives, by a lag well above scheduling noise."""
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if group.is_p2p or len(members) < 2:
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


def _straggler_finding(group: GroupKey, rank: int, n_last: int, complete: int,
                       lags: Mapping[int, list[float]]) -> Finding:
    median_lag = statistics.median(lags[rank])
    others = statistics.median(lag for r, ls in lags.items() if r != rank for lag in ls)
    return Finding(
        kind=Kind.STRAGGLER, severity=Severity.WARNING, group=group, odd_ranks=(rank,),
        summary=(f"Rank {rank} was the last to enter {n_last} of {complete} collectives on group {group}, a median "
                 f"{median_lag:.3f} s after the first rank (max {max(lags[rank]):.3f} s); every other rank waits "
                 f"for it each time. Look for extra work on that rank (data loading, logging, rank-specific code)."),
        data={"rank": rank, "last_in": n_last, "collectives": complete, "median_lag_s": round(median_lag, 4),
              "max_lag_s": round(max(lags[rank]), 4), "others_median_lag_s": round(others, 4)},
    )


def find_late_arrivals(table: Table, facts: RunFacts, outcomes: Mapping[int, RankOutcome],
                       max_reported: int = 5) -> list[Finding]:
    """Collectives every member entered, but some only a stall timeout or more after the others.

    distcheck kept waiting because the late rank was busy; the warning says who waited how
    long, for whom, and where the late rank was busy (a stack sample taken while the others waited).
    """
    if facts.stall_timeout_s is None:
        return []
    findings: list[Finding] = []
    collective = sorted((key, seqs) for key, seqs in table.items() if not key[0].is_p2p)   # a P2P pair is no collective
    for (group, members), seqs in collective:
        for seq in sorted(seqs):
            events = seqs[seq]
            if len(events) < max(2, len(members)):
                continue
            first = min(e.t_enter for e in events.values())
            last = max(e.t_enter for e in events.values())
            if last - first >= facts.stall_timeout_s and len(findings) < max_reported:
                findings.append(_late_finding(group, seq, events, outcomes, facts.late_evidence or {}))
    return findings


def _late_finding(group: GroupKey, seq: int, events: Mapping[int, Event], outcomes: Mapping[int, RankOutcome],
                  evidence: Mapping[int, str]) -> Finding:
    last = max(e.t_enter for e in events.values())
    late = sorted(r for r, e in events.items() if last - e.t_enter < 1.0)
    waiters = sorted(r for r in events if r not in late)
    waited = last - min(e.t_enter for e in events.values())
    ref = events[waiters[0]]
    busy = [outcomes[r].busy_at for r in late if r in outcomes and outcomes[r].busy_at]
    shown = [evidence[r] for r in late if r in evidence]
    # The stack sample is the main thread's: where the work was a child's (a data-loader worker), it only waited.
    where = f" (its main thread at {site(busy[0])})" if busy else ""
    it = "it" if len(late) == 1 else "them"
    why = (f"{it.capitalize()} was making progress ({shown[0]}), so distcheck took {it} for late, not hung, and kept "
           f"waiting. " if shown else "")
    summary = (f"{rank_list(waiters).capitalize()} waited {waited:.1f} s in {ref.op} #{seq} (group {group}) for "
               f"{rank_list(late)}{where}. {why}If this is expected (a rank-0-only evaluation or checkpoint save), "
               f"nothing is wrong; if not, look at what {rank_list(late)} does before this call.")
    details = tuple(detail(r, "late" if r in late else "waiting", e) for r, e in sorted(events.items()))
    return Finding(
        kind=Kind.STRAGGLER, severity=Severity.WARNING, group=group, seq=seq, op=ref.op, label=ref.label,
        callsite=ref.callsite, odd_ranks=tuple(late), waiting_ranks=tuple(waiters), ranks=details,
        summary=summary,
        data={"waited_s": round(waited, 3), "late_ranks": late, "busy_at": busy[0] if busy else None,
              "progress": shown[0] if shown else None},
    )
