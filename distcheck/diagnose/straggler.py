"""Stragglers: a rank that is the last one into most collectives, by a lag well
above scheduling noise. Pure.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Mapping

from distcheck.diagnose.common import RunFacts, Table
from distcheck.models import Finding


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
