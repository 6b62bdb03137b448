"""Calls node 0 compared by digest only: the blocks before a long trace's window (``files.trace_window``).
Pure.

Ranks whose digests of one block of a group differ issued another op or reduce op somewhere in those
calls: a mismatch, said with the block's numbers and where each odd rank's whole trace is (its own
node's launch dir), since the records that would name the call did not cross to node 0. A run whose
blocks all agree gets one info note: how many calls were compared that way, and where they are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from distcheck.files.trace_window import BLOCK, Elided
from distcheck.models import Finding, GroupKey, Kind, Severity
from distcheck.text import id_list, rank_list


def find_window_divergence(elided: Mapping[int, Mapping[str, Elided]]) -> list[Finding]:
    """One mismatch per group whose ranks' digests of a block differ (its first such block). Each rank's own
    groups only: every group against every rank was 26,000 groups x 16,384 ranks at a 3-D job's scale."""
    by_group: dict[str, dict[int, dict[str, list[int]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for rank, per_rank in sorted(elided.items()):
        for group, kept in per_rank.items():
            for block, digest in kept.digests.items():
                by_group[group][block][digest].append(rank)
    findings = []
    for group in sorted({g for per_rank in elided.values() for g in per_rank}):
        blocks = by_group.get(group, {})
        split = next((b for b in sorted(blocks) if len(blocks[b]) > 1), None)
        if split is not None:
            findings.append(_diverged(group, split, blocks[split], elided))
    return findings


def _diverged(group: str, block: int, by_digest: Mapping[str, list[int]],
              elided: Mapping[int, Mapping[str, Elided]]) -> Finding:
    sides = sorted(by_digest.values(), key=lambda ranks: (-len(ranks), ranks))
    tie = len(sides[0]) == len(sides[1])
    odd = sorted(r for side in sides[1:] for r in side)
    first, last = block * BLOCK + 1, (block + 1) * BLOCK
    held = _where(odd + (sides[0] if tie else []), group, elided)
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group=GroupKey.of(group), seq=first, odd_ranks=tuple(odd), tie=tie,
        fields=("op", "reduce_op"),
        summary=(f"{rank_list(odd).capitalize()} issued another collective (op or reduce op) than "
                 f"{rank_list(sides[0])} somewhere in calls #{first}-#{last} of group {group}: the digests of "
                 f"those calls differ. Their records stayed on the nodes ({held}); copy those traces into "
                 f"the launch dir's traces/ and run `distcheck analyze` on the run to name the call."),
        data={"block": [first, last], "sides": sides},
    )


def _where(ranks: list[int], group: str, elided: Mapping[int, Mapping[str, Elided]]) -> str:
    """Where the whole traces of ``ranks`` are: "rank 5 on node 1 in /path/rank5.trace; ..."."""
    parts = []
    for r in ranks[:4]:
        e = elided.get(r, {}).get(group)
        if e is None or e.held_at is None:
            parts.append(f"rank {r} on node 0, in its launch dir")
        else:
            parts.append(f"rank {r} on node {e.held_at[0]} in {e.held_at[1]}")
    more = len(ranks) - 4
    return "; ".join(parts) + (f"; {more} more" if more > 0 else "")


def window_note(elided: Mapping[int, Mapping[str, Elided]]) -> list[Finding]:
    """An info note: the calls node 0 compared by digest only, and where their records are."""
    cut = {r: sum(e.count for e in per_rank.values()) for r, per_rank in elided.items() if per_rank}
    if not cut:
        return []
    nodes = sorted({e.held_at[0] if e.held_at else 0 for per_rank in elided.values() for e in per_rank.values()})
    firsts: dict[str, int] = {}
    for per_rank in elided.values():
        for group, e in per_rank.items():
            firsts[group] = max(firsts.get(group, 0), e.first_kept)
    groups = ", ".join(f"#{first} of group {g}" for g, first in sorted(firsts.items())[:3])
    data: dict[str, Any] = {"calls_cut": sum(cut.values()), "ranks": len(cut), "first_kept": firsts}
    return [Finding(
        kind=Kind.COVERAGE, severity=Severity.INFO, data=data,
        summary=(f"Long traces: node 0 judged every rank on its calls from {groups} on, and the "
                 f"{sum(cut.values()):,} calls before them ({len(cut):,} ranks) by digests of their op and "
                 f"reduce op, blocks of {BLOCK}. Their records stayed on {_nodes(nodes)}, in each node's "
                 f"launch dir."),
    )]


def _nodes(nodes: list[int]) -> str:
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {id_list(nodes)}"
