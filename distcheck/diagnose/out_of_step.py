"""The rank out of step in a cycle of waits. Pure.

On a DeviceMesh every rank runs the same program over its own groups: on a (2, 2) mesh rank 0's
"dp" group is [0, 2] and rank 1's is [1, 3], but both are the dimension of pattern (0, 2)
(``library_shapes.group_pattern``). When one rank all-reduces over "tp" where every other rank uses
"dp", the groups wait on each other round the mesh: a cycle through every rank, where each wait
alone is symmetric and nobody is to blame. The program says more: each rank's calls, as (group
pattern, op) in the order it made them, are the same on every rank but one. That rank differs from
every rank it shares a group with, while each of those agrees with some other rank: it broke the
pattern, and the cycle is its consequence.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

from distcheck.diagnose.common import detail
from distcheck.knowledge.library_shapes import group_pattern
from distcheck.models import Cause, Event, Finding, Kind, Severity
from distcheck.text import rank_list, site

Step = tuple[tuple[int, ...], str]   # (group pattern, op)


def _steps(events: Sequence[Event], patterns: dict[int, tuple] | None = None) -> tuple[list[Step], list[Event]]:
    """A rank's calls on groups, and each as (group pattern, op). ``patterns`` (a group's members object's id ->
    (those members, their pattern)) shares each group's pattern between the ranks and calls: one tuple of its
    size per call was node 0's memory going from 0.5 to 10 GB at 16,384 ranks (a world group in every step)."""
    calls = [e for e in events if not e.is_p2p and len(e.group_ranks) >= 2]
    patterns = {} if patterns is None else patterns
    steps = []
    for e in calls:
        known = patterns.get(id(e.group_ranks))
        if known is None or known[0] is not e.group_ranks:
            known = patterns[id(e.group_ranks)] = (e.group_ranks, group_pattern(e.group_ranks))
        steps.append((known[1], e.op))
    return steps, calls


def _agree(a: Sequence[Step], b: Sequence[Step]) -> bool:
    """The same calls for as far as both got (a rank stuck early has made fewer)."""
    n = min(len(a), len(b))
    return list(a[:n]) == list(b[:n])


def _first_difference(a: Sequence[Step], b: Sequence[Step]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def out_of_step_ranks(traces: Mapping[int, Sequence[Event]]) -> dict[int, tuple[int, list[int]]]:
    """{rank: (index of its first call out of step, the ranks it shares a group with)} for every rank
    whose calls differ from each rank it shares a group with, while each of those agrees with another
    rank. Empty when no rank stands out that way (ranks that differ pairwise, a tie: nobody)."""
    patterns: dict[int, tuple] = {}
    steps = {r: _steps(es, patterns)[0] for r, es in traces.items()}
    groups = _groups_of(traces)
    out: dict[int, tuple[int, list[int]]] = {}
    for r in traces:
        if any(_agree(steps[r], steps[p]) for p in _peers(r, groups, traces)):
            continue   # the common case, decided at its first peer that agrees: no rank's peers made a set
        ps = set(_peers(r, groups, traces))
        if not ps:
            continue
        if not all(any(_agree(steps[p], steps[q]) for q in traces if q not in (p, r)) for p in ps):
            continue   # a peer that agrees with nobody else: no pattern to break
        at = min(i for p in ps for i in [_first_difference(steps[r], steps[p])] if i is not None)
        out[r] = (at, sorted(ps))
        if 2 * len(out) >= len(traces):
            return {}   # half the ranks or more "out of step": that is no pattern
    return out


def _groups_of(traces: Mapping[int, Sequence[Event]]) -> dict[int, list[tuple[int, ...]]]:
    """Each rank's groups as any record names them (a rank may never call one of its own), each group once:
    a set of every peer for each rank was 16,384 sets of 16,384 ranks where a step has a world group."""
    groups: dict[int, list[tuple[int, ...]]] = {r: [] for r in traces}
    seen: set[tuple[int, ...]] = set()
    seen_objects: set[int] = set()   # a group's members are one object in most records: not hashed again
    for es in traces.values():
        for e in es:
            if id(e.group_ranks) in seen_objects or e.is_p2p or len(e.group_ranks) < 2:
                continue
            seen_objects.add(id(e.group_ranks))
            if e.group_ranks in seen:
                continue
            seen.add(e.group_ranks)
            for m in e.group_ranks:
                if m in groups:
                    groups[m].append(e.group_ranks)
    return groups


def _peers(rank: int, groups: Mapping[int, list[tuple[int, ...]]], traces: Mapping[int, object]) -> Iterator[int]:
    """The ranks ``rank`` shares a group with (a rank in two of its groups more than once)."""
    for members in groups[rank]:
        for x in members:
            if x != rank and x in traces:
                yield x


def find_out_of_step(traces: Mapping[int, Sequence[Event]], hangs: Sequence[Finding]) -> list[Finding]:
    """An ``order`` finding for each rank out of step with its groups, when a cycle of waits goes
    through it (the cycle is its consequence)."""
    in_cycle = ranks_in_a_cycle(hangs)
    if not in_cycle:
        return []
    return [_finding(r, at, ps, traces) for r, (at, ps) in sorted(out_of_step_ranks(traces).items()) if r in in_cycle]


def ranks_in_a_cycle(hangs: Sequence[Finding]) -> set[int]:
    """The ranks whose waits lead back to themselves, across every hang finding (waiting → absent): a merged
    cycle finding, or, on a larger mesh, separate hangs (3 ranks waiting for 1 in one group, 1 for 3 in
    another) that ``hang.merge_cycles`` leaves apart because one side of a part is outnumbered."""
    edges: dict[int, set[int]] = {}
    for h in hangs:
        if h.kind is not Kind.HANG:
            continue
        for part in h.data.get("cycle") or ():
            for r in part.get("ranks", ()):
                edges.setdefault(r, set()).update(x for x in h.waiting_ranks if x != r)
        for r in h.waiting_ranks:
            edges.setdefault(r, set()).update(h.absent_ranks)
    return {r for r in edges if _reaches(r, r, edges)}


def _reaches(start: int, goal: int, edges: Mapping[int, set[int]]) -> bool:
    seen: set[int] = set()
    todo = list(edges.get(start, ()))
    while todo:
        r = todo.pop()
        if r == goal:
            return True
        if r not in seen:
            seen.add(r)
            todo.extend(edges.get(r, ()))
    return False


def caused_by_out_of_step(hangs: Sequence[Finding], culprits: Sequence[Finding]) -> list[Finding]:
    """The cycles through a rank out of step, marked as its consequence (shown after it)."""
    odd = {r: f for f in culprits for r in f.odd_ranks}
    in_cycle = ranks_in_a_cycle(hangs) if odd else set()
    out = []
    for h in hangs:
        cause = next((odd[r] for r in sorted(in_cycle) if r in odd), None) \
            if set(h.waiting_ranks) & in_cycle else None
        if cause is None:
            out.append(h)
            continue
        summary = (f"{h.summary} It follows from {rank_list(cause.odd_ranks)} out of step with its groups "
                   f"(see the order finding).")
        out.append(dataclasses.replace(h, summary=summary, caused_by=Cause.of(cause, ranks=True)))
    return out


def _finding(rank: int, at: int, peers: list[int], traces: Mapping[int, Sequence[Event]]) -> Finding:
    _, calls = _steps(traces[rank])
    mine = calls[at] if at < len(calls) else calls[-1]
    theirs: dict[int, Event] = {}
    for p in peers:
        _, p_calls = _steps(traces[p])
        if at < len(p_calls):
            theirs[p] = p_calls[at]
    wanted = Counter((group_pattern(e.group_ranks), e.op) for e in theirs.values()).most_common(1)
    want_pattern, want_op = wanted[0][0] if wanted else ((), mine.op)
    ref = next((e for _, e in sorted(theirs.items())
                if (group_pattern(e.group_ranks), e.op) == (want_pattern, want_op)), None)
    # its own group of that pattern, as any rank's record names it
    own = next((e for es in traces.values() for e in es if rank in e.group_ranks and not e.is_p2p
                and group_pattern(e.group_ranks) == want_pattern), None)
    members = lambda e: ", ".join(map(str, e.group_ranks))  # noqa: E731
    should = (f"rank {rank}'s own is group {own.group}: ranks {members(own)}" if own is not None
              else f"rank {rank} has no such group in the records")
    peer_side = (f"{rank_list(theirs)}, the ranks it shares a group with, make that call over a group like ranks "
                 f"{members(ref)} ({should}) at {site(ref.callsite)}" if ref
                 else f"the ranks it shares a group with ({rank_list(peers)}) agree on another pattern")
    summary = (f"Rank {rank} broke the pattern its groups follow: its call {at + 1} is {mine.op} #{mine.seq} "
               f"over group {mine.group} (ranks {members(mine)}) at {site(mine.callsite)}, where {peer_side}. "
               f"The other ranks' calls follow one pattern of (group, call); this one leaves their groups waiting "
               f"on each other in a cycle. Make this call over the same mesh dimension on every rank.")
    details = (detail(rank, "odd", mine), *(detail(p, "majority", e) for p, e in sorted(theirs.items())))
    return Finding(
        kind=Kind.ORDER, severity=Severity.ERROR, group=mine.group, seq=mine.seq, op=mine.op, label=mine.label,
        callsite=mine.callsite, odd_ranks=(rank,), fields=("group",), tie=False,
        majority=ref.fingerprint() if ref else None, ranks=details, summary=summary,
        data={"out_of_step": {"rank": rank, "call": at + 1, "peers": peers,
                              "group": mine.group, "group_ranks": list(mine.group_ranks),
                              "expected_group": own.group if own is not None else None,
                              "expected_group_ranks": list(own.group_ranks) if own is not None else None}},
    )
