"""Count differences: ranks of one group that issued different numbers of
collectives by the end of a run that nothing else explains, told apart from
records distcheck lost (only where the rank's own counters or a peer's
completed call prove the call was made). Pure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping

from distcheck.diagnose.common import ABNORMAL_ENDS, RunFacts, Table, detail, majority
from distcheck.models import EndReason, Event, Finding, GroupKey, Hook, Kind, RankOutcome, Severity
from distcheck.text import rank_list, site


# Calls that return on a rank only once every member entered them: one that returned without error
# proves the members that lack it in their record did issue it.
ALL_ENTER = {"all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
             "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
             "barrier"}
ROOT_GETS_ALL = {"reduce", "gather", "gather_object"}          # the root returns once every rank sent
FROM_ROOT = {"broadcast", "broadcast_object_list", "scatter", "scatter_object_list"}   # a receiver needs the root
RECV_OPS = {"recv", "recv_object_list"}


def find_count_differences(table: Table, facts: RunFacts,
                           outcomes: Mapping[int, RankOutcome] | None = None) -> list[Finding]:
    """Ranks of one group that issued different numbers of collectives by the end of a run that ended on its
    own (a run cut short leaves calls open: a hang says that, and a crash explains what follows it).

    A call a rank lacks is distcheck's loss only with evidence (``_lost_evidence``): the rank's own
    numbering went past it, its Flight Recorder counted it, or a peer returned from a call that
    returns only once every member entered it. Said as a ``coverage`` warning, never as the user's
    error. Without evidence the rank never called it: the job's divergence, said as what happened.
    """
    if facts.end_reason in ABNORMAL_ENDS or facts.end_reason == EndReason.MAX_DURATION:
        return []
    findings = []
    for (group, members), seqs in sorted(table.items()):
        counts = _counts(members, seqs)
        if len(set(counts.values())) <= 1:
            continue
        lost: dict[int, list[int]] = defaultdict(list)
        reasons: dict[int, str] = {}
        never: dict[int, tuple[int, ...]] = {}     # seq -> ranks that never called it
        for seq, events in sorted(seqs.items()):
            absent = [m for m in members if m not in events]
            not_called = []
            for r in absent:
                why = _lost_evidence(r, group, seq, events, seqs, outcomes)
                if why:
                    lost[r].append(seq)
                    reasons.setdefault(r, why)
                else:
                    not_called.append(r)
            if not_called:
                never[seq] = tuple(not_called)
        if lost:
            findings.append(_lost_records(group, seqs, counts, dict(lost), reasons))
        findings.extend(_divergence(group, members, seqs, never))
    return findings


def _counts(members: tuple[int, ...], seqs: Mapping[int, Mapping[int, Event]]) -> dict[int, int]:
    counts = Counter({m: 0 for m in members})
    for events in seqs.values():
        counts.update(events.keys())
    return {m: counts[m] for m in members}


def _lost_evidence(rank: int, group: GroupKey, seq: int, events: Mapping[int, Event],
                   seqs: Mapping[int, Mapping[int, Event]], outcomes: Mapping[int, RankOutcome] | None) -> str | None:
    """Why rank ``rank`` must have issued call ``seq`` that its record lacks; None: nothing says it did."""
    if any(s > seq and rank in evs for s, evs in seqs.items()):
        return "its own numbering went past it"   # the group's counter (or the tracer's) counted it
    outcome = (outcomes or {}).get(rank)
    fr = (outcome.flight_recorder or {}).get(group) if outcome is not None else None
    if fr and not group.is_p2p and fr.get("last_enqueued_collective", 0) >= seq:
        return "its Flight Recorder counted it"
    # the rank's own counters: calls its hooks could not write (rule 0 let them run unrecorded), as many as it lacks
    failed = _recording_failures(outcome, lacks=sum(1 for evs in seqs.values() if rank not in evs))
    if failed:
        return failed
    for peer, e in events.items():
        if e.t_exit is None or e.error or e.async_op:
            continue
        if (e.op in ALL_ENTER or (e.op in ROOT_GETS_ALL and e.root == peer)
                or (e.op in FROM_ROOT and e.root == rank) or e.op in RECV_OPS):
            return f"rank {peer} returned from {e.op} #{seq}, which returns only once every member entered it"
    return None


def _recording_failures(outcome: RankOutcome | None, lacks: int) -> str | None:
    """What the rank's own counters say its recorders failed to write, when they failed at least as often as the
    rank lacks calls: its tracer (Python calls) or its sidecar (C++-issued calls) caught an error of its own and
    let a call run unrecorded."""
    failures = (outcome.hook_failures or {}) if outcome is not None else {}
    counts = {hook: int(failures[hook].get("count", 1)) for hook in (Hook.TRACER.value, Hook.SIDECAR.value)
              if hook in failures}
    if not counts or sum(counts.values()) < lacks:
        return None
    return " and ".join(f"its {hook} failed {n} time(s)" for hook, n in counts.items()) + " (calls it could not record)"


def _divergence(group: GroupKey, members: tuple[int, ...], seqs: Mapping[int, Mapping[int, Event]],
                never: Mapping[int, tuple[int, ...]]) -> list[Finding]:
    """Calls some members never made: a partial new_group and a call that raised on the ranks that
    entered it alone are each said as what happened; the rest is a count difference."""
    out: list[Finding] = []
    said: set[int] = set()
    for seq, absent in sorted(never.items()):
        events = seqs[seq]
        if all(e.op == "new_group" for e in events.values()):
            out.append(_partial_new_group(group, seq, events, absent))
            said.add(seq)
        elif all(e.error for e in events.values()):
            out.append(_entered_alone(group, seq, events, absent))
            said.add(seq)
    # A call only lost records lack is no difference of the job's: leave it out of the counts.
    rest = {s: evs for s, evs in seqs.items() if s not in said and (s in never or len(evs) == len(members))}
    counts = _counts(members, rest)
    if len(set(counts.values())) > 1:
        out.append(_count_finding(group, rest, counts))
    return out


def _partial_new_group(group: GroupKey, seq: int, events: Mapping[int, Event], absent: tuple[int, ...]) -> Finding:
    made = sorted(events)
    e = events[made[0]]
    asked = f" for ranks {list(e.members)}" if e.members else ""
    return Finding(
        kind=Kind.COUNT, severity=Severity.ERROR, group=group, seq=seq, op="new_group", label=e.label,
        callsite=e.callsite,
        odd_ranks=tuple(absent), fields=("count",),
        ranks=tuple([detail(r, "created", events[r]) for r in made]
                    + [detail(r, "never called", None) for r in absent]),
        summary=(f"new_group #{seq}{asked} was created by {rank_list(made)} only (at {site(e.callsite)}); "
                 f"{rank_list(absent)} never called it. A new_group must be called by every rank of the job, "
                 f"members or not, in the same order: torch numbers groups with a job-wide counter, so every group "
                 f"created after it pairs the wrong ranks or waits forever. Call it on every rank, or pass "
                 f"use_local_synchronization=True so that only its members create it."),
        data={"created_by": made, "never_called": list(absent)},
    )


def _entered_alone(group: GroupKey, seq: int, events: Mapping[int, Event], absent: tuple[int, ...]) -> Finding:
    """A call the other members never made, which raised (its time-out) on the ranks that entered it."""
    entered = sorted(events)
    e = events[entered[0]]
    waited = f" after {e.t_exit - e.t_enter:.1f} s" if e.t_exit is not None else ""
    return Finding(
        kind=Kind.COUNT, severity=Severity.INFO, group=group, seq=seq, op=e.op, label=e.label, callsite=e.callsite,
        odd_ranks=tuple(entered), fields=("count",),
        ranks=tuple([detail(r, "entered", events[r]) for r in entered]
                    + [detail(r, "never called", None) for r in absent]),
        summary=(f"{e.op} #{seq} (group {group}) was entered by {rank_list(entered)} alone (at {site(e.callsite)}); "
                 f"{rank_list(absent)} never called it, and it raised{waited} on {rank_list(entered)}: {e.error}. "
                 f"The program went on after the error."),
        data={"entered": entered, "never_called": list(absent), "error": e.error},
    )


def _lost_records(group: GroupKey, seqs: Mapping[int, Mapping[int, Event]], counts: Mapping[int, int],
                  missing: Mapping[int, list[int]], reasons: Mapping[int, str]) -> Finding:
    said = "; ".join(f"rank {r} lacks {_numbers(m)} ({reasons[r]})" for r, m in sorted(missing.items()))
    return Finding(
        kind=Kind.COVERAGE, severity=Severity.WARNING, group=group, odd_ranks=tuple(sorted(missing)),
        summary=(f"distcheck lost records on group {group}: {said}. Those calls were not compared; "
                 f"this is distcheck's shortcoming, not your job's (please report it)."),
        data={"missing": {str(r): m for r, m in sorted(missing.items())},
              "evidence": {str(r): why for r, why in sorted(reasons.items())},
              "counts": {str(r): c for r, c in counts.items()}},
    )


def _numbers(seqs: list[int]) -> str:
    shown = ", ".join(f"#{s}" for s in seqs[:8])
    return shown + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")


def _count_finding(group: GroupKey, seqs: Mapping[int, Mapping[int, Event]], counts: Mapping[int, int]) -> Finding:
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
        kind=Kind.COUNT, severity=Severity.ERROR, group=group, odd_ranks=tuple(odd), tie=tie, fields=("count",),
        majority={"count": expected} if not tie else None, summary=summary + ".", ranks=tuple(details),
        data={"counts": {str(r): c for r, c in sorted(counts.items())}},
    )
