"""Crossed calls (``order``): the signatures match, so the backend pairs them
silently, but the calls come from different metrics/modules. Pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from distcheck.models import Event, Finding, GroupKey, Kind, RankDetail, Severity
from distcheck.text import rank_list


def crossing_finding(group: GroupKey, seq: int, events: Mapping[int, Event], details: tuple[RankDetail, ...],
                     odd: tuple[int, ...], tie: bool, expected_label: Any) -> Finding:
    """Ranks met at (group, seq) with the same signature but from different labels; the odd
    side is ``odd`` unless it is a ``tie``, and ``expected_label`` is the majority's."""
    by_label: dict[str, list[int]] = defaultdict(list)
    for r, e in sorted(events.items()):
        by_label[e.label or "(no module)"].append(r)
    sides = " meets ".join(f"{label} on {rank_list(rs)}" for label, rs in by_label.items())
    sample = events[min(events)]
    ref = None if tie else next(e for _, e in sorted(events.items()) if e.label == expected_label)
    summary = (f"Crossed calls at {sample.op} #{seq} (group {group}): {sides}. The signatures match, so the "
               f"backend pairs them without any error and the values are exchanged between different "
               f"metrics/modules" + (" (a tie: no side has a majority)" if tie else "")
               + ". Call them in the same order on every rank.")
    return Finding(
        kind=Kind.ORDER, severity=Severity.ERROR, summary=summary, group=group, seq=seq, op=sample.op,
        label=ref.label if ref else None, callsite=ref.callsite if ref else None,
        odd_ranks=odd, fields=("label",), tie=tie,
        majority=ref.fingerprint() | {"label": ref.label} if ref else None, ranks=details,
        data={"labels": dict(by_label)},
    )
