"""What distcheck could not watch on a rank, said once instead of staying silent. Pure."""

from __future__ import annotations

from typing import Mapping

from distcheck.models import Finding, RankOutcome
from distcheck.text import rank_list


def find_coverage_gaps(outcomes: Mapping[int, RankOutcome]) -> list[Finding]:
    """An info finding per distinct reason a rank's C++-issued collectives went unwatched."""
    by_reason: dict[str, list[int]] = {}
    for rank, o in sorted(outcomes.items()):
        if o.unwatched:
            by_reason.setdefault(o.unwatched, []).append(rank)
    return [Finding(kind="coverage", severity="info", odd_ranks=tuple(ranks),
                    summary=f"On {rank_list(ranks)}, {reason}.", data={"reason": reason})
            for reason, ranks in by_reason.items()]
