"""An async collective whose handle some ranks never waited on before they went on.

``all_reduce(t, async_op=True)`` returns at once; until ``work.wait()`` the tensor is not reduced. A
rank that reads it without waiting (an early-stopping decision on an unreduced loss) decides on its
own value, and its peers, who waited, on the reduced one: that is where the ranks part, though the
records only show it at a later call. Where the ranks then parted (an error finding after it), this
names the async call's line, the ranks that went on without waiting, and those that waited.

A rank waited when it began ``wait()`` on the call's handle (its W record) before its next call on
that group, or at all where it made none. Calls numbered apart (P2P) are judged by the wait-for rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from distcheck.knowledge.library_shapes import P2P_CALLS
from distcheck.models import Event, Finding, GroupKey, Kind, RankDetail, Severity
from distcheck.text import rank_list


def find_unwaited_handles(traces: Mapping[int, Sequence[Event]],
                          waited: Mapping[int, Mapping[tuple[str, int], float]],
                          later: Iterable[Finding]) -> list[Finding]:
    """One error per async call that some ranks waited on and others went on from, where the ranks
    parted later (``later``: the run's other findings)."""
    parted = [f for f in later if f.severity is Severity.ERROR]
    if not parted or not waited:
        return []
    calls: dict[tuple[GroupKey, int], dict[int, tuple[Event, bool]]] = {}
    for rank, events in traces.items():
        for event, did_wait in _async_calls(events, waited.get(rank, {})):
            calls.setdefault((event.group, event.seq), {})[rank] = (event, did_wait)
    out = []
    for (group, seq), ranks in sorted(calls.items(), key=lambda item: item[0][1]):
        went_on = sorted(r for r, (_, w) in ranks.items() if not w)
        waited_ranks = sorted(r for r, (_, w) in ranks.items() if w)
        if went_on and waited_ranks:
            out.append(_finding(group, seq, ranks, went_on, waited_ranks, parted[0]))
    return out


def _async_calls(events: Sequence[Event], waits: Mapping[tuple[str, int], float]) -> Iterable[tuple[Event, bool]]:
    """Each async collective of one rank, and whether the rank began waiting on its handle before its
    next call on the same group."""
    for i, event in enumerate(events):
        if event.is_p2p or not event.async_op or event.native or event.op in P2P_CALLS:
            continue
        began = waits.get((event.group, event.seq))
        after = next((e.t_enter for e in events[i + 1:] if e.group == event.group), None)
        yield event, began is not None and (after is None or began <= after)


def _finding(group: GroupKey, seq: int, ranks: Mapping[int, tuple[Event, bool]], went_on: list[int],
             waited: list[int], parted: Finding) -> Finding:
    event = ranks[went_on[0]][0]
    where = f" at {event.callsite}" if event.callsite else ""
    later = f"{parted.kind} at {parted.op} #{parted.seq}" if parted.op and parted.seq else parted.kind
    summary = (f"{rank_list(went_on).capitalize()} went on from {event.op} #{seq} (async_op=True){where} without "
               f"waiting on its handle, while {rank_list(waited)} waited: the tensor was read before it was "
               f"reduced there, and the ranks parted after it ({later}). Call work.wait() on every rank "
               f"before using the result.")
    details = tuple(RankDetail(rank=r, role="went on" if r in went_on else "waited", op=e.op, seq=seq,
                               callsite=e.callsite) for r, (e, _) in sorted(ranks.items()))
    return Finding(kind=Kind.ORDER, severity=Severity.ERROR, summary=summary, group=group, seq=seq, op=event.op,
                   label=event.label, callsite=event.callsite, odd_ranks=tuple(went_on), ranks=details,
                   data={"cause": "unwaited_handle", "went_on": went_on, "waited": waited})
