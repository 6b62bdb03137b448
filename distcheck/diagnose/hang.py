"""Hangs: ranks waiting in a (group, seq) that others never entered or that
never completed; ranks that never got past start-up; a run past its --timeout. Pure.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence

from distcheck.diagnose.apart import apart_summary, calls_apart
from distcheck.diagnose.common import ABNORMAL_ENDS, RunFacts, Table, detail, whereabouts, who
from distcheck.knowledge.library_shapes import waits_elsewhere
from distcheck.models import (Cause, EndReason, Event, Finding, GroupKey, Kind, Phase, RankDetail, RankOutcome, is_p2p,
                              RankState, Severity)
from distcheck.text import rank_list, site


def _reached(seqs: Mapping[int, Mapping[int, Event]], members: tuple[int, ...]) -> dict[int, int]:
    """The highest sequence number each member entered (0: none)."""
    reached = dict.fromkeys(members, 0)
    for seq, events in seqs.items():
        for r in events:
            if seq > reached.get(r, 0):
                reached[r] = seq
    return reached


def find_hangs(table: Table, outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    """Ranks waiting in a call others never entered or that never completed (a mismatch in that very call is
    linked to it afterwards: ``because_of``)."""
    if facts.end_reason not in ABNORMAL_ENDS:
        return []
    detected_after = None
    if facts.stall_onset is not None and facts.detected_at is not None:
        detected_after = round(facts.detected_at - facts.stall_onset, 3)
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if len(members) < 2:
            continue
        reached = _reached(seqs, members)
        # a member whose records went with a lost node reached no call that anyone knows of: the others' calls
        # say where the group stands (its DP group waiting on a lost node's rank was no finding at all)
        known = [n for r, n in reached.items() if r not in facts.records_lost] or list(reached.values())
        if len(set(known)) > 1:
            seq = min(known) + 1
        else:
            seq = max(known)
            if all(e.completed for e in seqs.get(seq, {}).values()):
                continue
        present = seqs.get(seq, {})
        if not present:
            continue
        absent = sorted(m for m in members if m not in present)
        if set(absent) <= set(facts.records_lost) and all(e.completed for e in present.values()):
            continue   # they returned, so the absent entered it: only their records are missing (a lost node)
        last = {r: seqs[reached[r]][r] for r in absent if reached[r]}
        sides = calls_apart(present) if facts.unnumbered else None
        if sides is not None:   # read from outside: ranks at different calls are not known to be in one
            findings.append(_apart_finding(group, seq, present, sides, absent, outcomes, last, detected_after))
            continue
        split = waits_elsewhere(present)
        if split is not None:   # a barrier on one side, a data call on the other: each waits in its own
            findings.append(_elsewhere_finding(group, seq, *split, absent, outcomes, last, detected_after))
            continue
        findings.append(_hang_finding(group, seq, present, absent, outcomes, last, detected_after,
                                      facts.records_lost))
    # alike waits merged after the fold: those downstream of a root are a sentence of it, not a finding of their own
    findings = merge_alike_hangs(fold_downstream(roots_first(merge_alike_cycles(merge_cycles(findings)))))
    if facts.evidence:
        findings = [dataclasses.replace(f, summary=f"{f.summary} Decided: {facts.evidence}.",
                                        data={**f.data, "evidence": facts.evidence}) for f in findings]
    return findings


def roots_first(findings: list[Finding]) -> list[Finding]:
    """The calls the others wait on before the waits they cause: a hang whose absent ranks wait in no other
    hang's call comes first (a TP group stuck in its all-reduce, ahead of the DP and pipeline waits of
    thousands of ranks downstream of it); otherwise the order stays."""
    waiting = {r for f in findings for r in f.waiting_ranks}
    return sorted(findings, key=lambda f: any(r in waiting for r in f.absent_ranks))


FOLD_PAST = 8   # more waits downstream of the root hangs than this: said as one sentence on each root, not each


def fold_downstream(findings: list[Finding]) -> list[Finding]:
    """The waits a stuck call causes, said with it when they are many: a hang whose absent ranks all wait in
    another hang's call is downstream of it. Past ``FOLD_PAST`` of them (a TP group stuck in its all-reduce, and
    the DP all-gathers and pipeline receives of thousands of ranks waiting on it: one finding per group), each root
    says how many ranks wait downstream of it and in which calls (``data["downstream"]``), and they are not
    findings of their own: a 16,384-rank job's report was every DP group's and pipeline pair's wait."""
    waiting_in = {r: i for i, f in enumerate(findings) for r in f.waiting_ranks}
    feeds = {i: {waiting_in[a] for a in f.absent_ranks if a in waiting_in} - {i} for i, f in enumerate(findings)}
    down = [i for i, f in enumerate(findings) if f.absent_ranks and len(feeds[i]) and
            all(a in waiting_in for a in f.absent_ranks)]
    downstream = set(down)   # once: in the comprehension, a set per finding was 24,584² steps at 16,384 ranks
    roots = [i for i in range(len(findings)) if i not in downstream]
    if len(down) <= FOLD_PAST or not roots:
        return findings
    below: dict[int, set[int]] = {i: set() for i in roots}   # root -> the downstream findings that wait on it
    for i in down:
        seen, todo = {i}, list(feeds[i])
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            seen.add(j)
            if j in below:
                below[j].add(i)
            else:
                todo += feeds[j]
    return [_with_downstream(findings[i], [findings[j] for j in sorted(below[i])]) for i in roots]


def _with_downstream(root: Finding, below: list[Finding]) -> Finding:
    if not below:
        return root
    ranks = sorted({r for f in below for r in f.waiting_ranks} - set(root.waiting_ranks))
    ops = Counter(f.op for f in below)
    calls = ", ".join(f"{op} x{n}" if n > 1 else str(op) for op, n in ops.most_common())
    said = (f" {rank_list(ranks).capitalize()} wait downstream of it, in {len(below)} calls of other groups "
            f"({calls}): each waits on a rank that waits here.")
    return dataclasses.replace(root, summary=root.summary + said, data={**root.data, "downstream": {
        "ranks": len(ranks), "calls": len(below), "ops": dict(ops)}})


ALIKE_PAST = 2   # more cycles of one shape than this (the same calls, other ranks): said as one finding


def merge_alike_cycles(findings: list[Finding]) -> list[Finding]:
    """Cycles of the same calls on other ranks are one fault said once: a pipeline stage that skipped a micro-batch
    leaves one cycle per TP lane of the stage pair (8 findings alike at tp=8), each naming the same calls."""
    def shape(f: Finding) -> tuple | None:
        parts = f.data.get("cycle")
        return tuple((p["op"], p["seq"], p["callsite"], len(p["ranks"])) for p in parts) if parts else None

    return _merge_alike(findings, shape, _alike)


def _merge_alike(findings: list[Finding], shape: Callable[[Finding], tuple | None],
                 merge: Callable[[list[Finding]], Finding]) -> list[Finding]:
    """More than ``ALIKE_PAST`` findings of one shape are one, said by ``merge``, where the first of them stood."""
    alike: dict[tuple, list[int]] = defaultdict(list)
    for i, f in enumerate(findings):
        key = shape(f)
        if key is not None:
            alike[key].append(i)
    merged = {idx[0]: [findings[i] for i in idx] for idx in alike.values() if len(idx) > ALIKE_PAST}
    gone = {i for idx in alike.values() if len(idx) > ALIKE_PAST for i in idx[1:]}
    return [merge(merged[i]) if i in merged else f for i, f in enumerate(findings) if i not in gone]


def _alike(cycles: list[Finding]) -> Finding:
    first = cycles[0]
    waiting = tuple(sorted(r for f in cycles for r in f.waiting_ranks))
    said = (f"{rank_list(waiting).capitalize()} wait for each other in {len(cycles)} cycles alike (the same calls, "
            f"other ranks); the first: {first.summary}")
    return dataclasses.replace(first, waiting_ranks=waiting, summary=said, ranks=tuple(
        d for f in cycles for d in f.ranks), data={**first.data, "alike": [list(f.waiting_ranks) for f in cycles]})


def merge_alike_hangs(findings: list[Finding]) -> list[Finding]:
    """The same call stuck in many groups of other ranks is one fault said once: a node lost mid-step leaves every
    DP group that had one of its 8 ranks waiting in the same all-gather (8 findings alike), and every pipeline
    pair in the same receive. Roots only (what they wait for waits in no other hang); cycles are
    ``merge_alike_cycles``'."""
    waiting = {r for f in findings for r in f.waiting_ranks}

    def shape(f: Finding) -> tuple | None:
        # roots only: a few waits downstream of another hang stay findings of their own (``fold_downstream``)
        if f.kind != Kind.HANG or f.data.get("cycle") or f.group is None or waiting & set(f.absent_ranks):
            return None
        absent = tuple(sorted({d.state or "" for d in f.ranks if d.role == "absent"}))
        return (f.op, f.seq, f.callsite, is_p2p(f.group), len(f.waiting_ranks), len(f.absent_ranks), absent)

    return _merge_alike(findings, shape, _alike_hang)


def _alike_hang(hangs: list[Finding]) -> Finding:
    first = hangs[0]
    waiting = tuple(sorted(r for f in hangs for r in f.waiting_ranks))
    absent = tuple(sorted(r for f in hangs for r in f.absent_ranks))
    said = (f"{rank_list(waiting).capitalize()} wait in {len(hangs)} calls alike ({first.op} #{first.seq} at "
            f"{site(first.callsite)}, each in a group of other ranks) for {rank_list(absent)}; the first: "
            f"{first.summary}")
    return dataclasses.replace(first, waiting_ranks=waiting, absent_ranks=absent, summary=said, ranks=tuple(
        d for f in hangs for d in f.ranks), data={**first.data, "alike": [list(f.waiting_ranks) for f in hangs],
                                                  "alike_groups": [str(f.group) for f in hangs]})


def merge_cycles(findings: list[Finding]) -> list[Finding]:
    """Hangs that wait for each other are one hang: rank 0 in send to 1 while rank 1 is in send to 0
    (each alone reads "the other never entered it", and the advice "call it on all ranks" is wrong).
    Only where no side is outnumbered: 1 rank against 3 is still the odd one out, said by majority."""
    in_hang = {r: i for i, f in enumerate(findings) for r in f.waiting_ranks}
    edges = {i: {in_hang[a] for a in f.absent_ranks if a in in_hang} for i, f in enumerate(findings)}
    merged, done = [], set()
    for i in range(len(findings)):
        if i in done:
            continue
        cycle = _cycle_through(i, edges)
        if len(cycle) < 2 or not all(_symmetric(findings[j]) for j in cycle):
            continue   # one side outnumbered: "the odd one out" (majority) says more than "a cycle"
        done |= cycle
        merged.append(_cycle_finding([findings[j] for j in sorted(cycle)]))
    return merged + [f for i, f in enumerate(findings) if i not in done]


def _symmetric(f: Finding) -> bool:
    """A part of a cycle with no majority to blame: a P2P call, or as many ranks waiting as absent."""
    return (f.group is not None and f.group.is_p2p) or len(f.waiting_ranks) == len(f.absent_ranks)


def _cycle_through(start: int, edges: Mapping[int, set[int]]) -> set[int]:
    """The findings on a cycle of waits through ``start`` (empty when there is none)."""
    path, seen = [start], {start}

    def walk(node: int) -> set[int] | None:
        for nxt in sorted(edges[node]):
            if nxt == start:
                return set(path)
            if nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                found = walk(nxt)
                if found:
                    return found
                path.pop()
        return None

    return walk(start) or set()


def _cycle_finding(parts: list[Finding]) -> Finding:
    waiting = tuple(sorted(r for f in parts for r in f.waiting_ranks))
    where = "; ".join(f"{rank_list(f.waiting_ranks)} in {f.op} #{f.seq} ({_group_words(f.group)}) at {site(f.callsite)}"
                      for f in parts)
    p2p = all(f.group is not None and f.group.is_p2p for f in parts)
    advice = ("Order the pair (even ranks send first, odd ranks receive first), or post both with "
              "batch_isend_irecv / isend + irecv." if p2p and all(f.op == "send" for f in parts) else
              "Every rank must enter these groups' collectives in the same order.")
    return Finding(
        kind=Kind.HANG, severity=Severity.ERROR, group=parts[0].group, seq=parts[0].seq, op=parts[0].op,
        label=parts[0].label,
        callsite=parts[0].callsite, waiting_ranks=waiting, absent_ranks=(),
        detected_after_s=parts[0].detected_after_s,
        summary=(f"{rank_list(waiting).capitalize()} wait for each other (a cycle; none can finish first): "
                 f"{where}. {advice}"),
        ranks=tuple(dataclasses.replace(d, role="waiting") for f in parts for d in f.ranks if d.role == "waiting"),
        data={"cycle": [{"group": f.group, "seq": f.seq, "op": f.op, "ranks": list(f.waiting_ranks),
                         "callsite": f.callsite} for f in parts]},
    )


def _group_words(group: GroupKey | None) -> str:
    if group is not None and group.is_p2p:
        return f"from rank {group.src_text} to rank {group.dst}"
    return f"group {group}"


_LOST = "their records went with their lost node"


def _elsewhere_finding(group: GroupKey, seq: int, sync: Mapping[int, Event], others: Mapping[int, Event],
                       absent: list[int], outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event],
                       detected_after: float | None) -> Finding:
    """Ranks waiting in a barrier while their peers wait, at the same number, in a call that moves data:
    the ones in the barrier arrived; the others never entered it, each stuck at its own line."""
    found = _hang_finding(group, seq, sync, absent, outcomes, last, detected_after)
    elsewhere = {r: f"waiting in {e.op} #{e.seq} {who(e)}" for r, e in sorted(others.items())}
    by_where: dict[str, list[int]] = defaultdict(list)
    for r, text in elsewhere.items():
        by_where[text].append(r)
    ref = next(iter(sorted(sync.items())))[1]
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    verb = "is" if len(sync) == 1 else "are"
    summary = (f"{rank_list(sorted(sync)).capitalize()} {verb} waiting in {ref.op} #{seq} (group {group}) {called}; "
               + "; ".join(f"{rank_list(rs)} never entered it ({w})" for w, rs in by_where.items())
               + (f"; {rank_list(absent)} never entered it" if absent else "")
               + ". The ranks took different paths: each side waits in its own call and neither can finish. "
                 "Every rank must reach the barrier after the same collectives (the same number of steps).")
    details = tuple(d for d in found.ranks if d.role == "waiting") + tuple(
        detail(r, "absent", e, state=outcomes[r].state if r in outcomes else None, note=elsewhere[r])
        for r, e in sorted(others.items())) + tuple(d for d in found.ranks if d.role == "absent")
    return dataclasses.replace(found, summary=summary, absent_ranks=tuple(sorted([*others, *absent])), ranks=details,
                               data={**found.data, "elsewhere": {str(r): {"op": e.op, "callsite": e.callsite,
                                                                          "label": e.label}
                                                                 for r, e in sorted(others.items())}})


def _apart_finding(group: GroupKey, seq: int, present: Mapping[int, Event], sides: list[list[int]],
                   absent: list[int], outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event],
                   detected_after: float | None) -> Finding:
    """Ranks whose stacks stand at different calls, read from outside (``diagnose.apart``): the call of the fewest
    is the finding's, the others where they stand; ranks outside every collective as the hang rule says them."""
    found = _hang_finding(group, seq, {r: present[r] for r in sides[0]}, absent, outcomes, last, detected_after)
    where: dict[str, list[int]] = defaultdict(list)
    for d in found.ranks:
        if d.role == "absent":
            where[d.note or "where, not known"].append(d.rank)
    outside = "; ".join(f"{rank_list(rs)} in none ({w})" for w, rs in where.items())
    summary = apart_summary(present, sides) + (f" Outside every collective: {outside}." if outside else "")
    details = tuple(detail(r, "waiting", present[r], state=outcomes[r].state if r in outcomes else None)
                    for r in sorted(present)) + tuple(d for d in found.ranks if d.role == "absent")
    return dataclasses.replace(found, summary=summary, waiting_ranks=tuple(sorted(present)), ranks=details,
                               data={**found.data, "apart": [list(ranks) for ranks in sides]})


def _hang_finding(group: GroupKey, seq: int, present: Mapping[int, Event], absent: list[int],
                  outcomes: Mapping[int, RankOutcome], last: Mapping[int, Event],
                  detected_after: float | None, records_lost: tuple[int, ...] = ()) -> Finding:
    waiting = sorted(present)
    op = Counter(e.op for e in present.values()).most_common(1)[0][0]
    ref = next(e for _, e in sorted(present.items()) if e.op == op)
    where = {r: _LOST if r in records_lost else whereabouts(r, outcomes.get(r), last.get(r)) for r in absent}
    details = [detail(r, "waiting", present[r], state=outcomes[r].state if r in outcomes else None) for r in waiting]
    details += [RankDetail(rank=r, role="absent", state=outcomes[r].state if r in outcomes else None,
                           where=outcomes[r].where if r in outcomes else None, note=where[r]) for r in absent]
    verb = "is" if len(waiting) == 1 else "are"
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    summary = f"{rank_list(waiting).capitalize()} {verb} waiting in {op} #{seq} (group {group}) {called}"
    summary += on_the_device(present, outcomes)
    if absent:
        groups: dict[str, list[int]] = defaultdict(list)
        for r in absent:
            groups[where[r]].append(r)
        summary += "; " + "; ".join(f"{rank_list(rs)} never entered it ({w})" if w != _LOST else
                                    f"{rank_list(rs)}: not known ({w})" for w, rs in groups.items())
        summary += ". Every rank must issue the same collectives in the same order: call it on all ranks."
    else:
        summary += _NEVER_COMPLETED
    return Finding(
        kind=Kind.HANG, severity=Severity.ERROR, summary=summary, group=group, seq=seq, op=op, label=ref.label,
        callsite=ref.callsite, waiting_ranks=tuple(waiting), absent_ranks=tuple(absent),
        detected_after_s=detected_after, ranks=tuple(details),
    )


_NEVER_COMPLETED = "; every rank entered it but it never completed (a mismatch or a backend/network fault)."


def because_of(hang: Finding, mismatches: Sequence[Finding]) -> Finding:
    """A hang in a call every member entered, as the consequence of the mismatch in that very call, where
    there is one; else the hang as it is. A cycle and ranks waiting at two lines have their own story."""
    if hang.seq is None or "cycle" in hang.data or "elsewhere" in hang.data:
        return hang
    cause = next((m for m in mismatches if (m.group, m.seq) == (hang.group, hang.seq)), None)
    if cause is None:
        return hang
    summary = hang.summary if hang.absent_ranks else hang.summary.replace(
        _NEVER_COMPLETED, f"; every rank entered it but it never completed, most likely because of the "
                          f"{' and '.join(cause.fields)} mismatch in this very call (see the mismatch finding).", 1)
    return dataclasses.replace(hang, summary=summary, caused_by=Cause.of(cause))


def on_the_device(present: Mapping[int, Event], outcomes: Mapping[int, RankOutcome]) -> str:
    """Where the host of each rank whose call returned before its work completed (NCCL) went on to, in words:
    " (it returned, but its work never completed; the host is blocked at train.py:42)"."""
    enqueued = sorted(r for r, e in present.items() if e.enqueued)
    if not enqueued:
        return ""
    at: dict[str, list[int]] = defaultdict(list)
    for r in enqueued:
        o = outcomes.get(r)
        at["finished: its script ended" if o is not None and o.state == RankState.FINISHED else
           f"the host is blocked at {site(o.where)}" if o is not None and o.where else "the host went on"].append(r)
    said = "; ".join(text if len(at) == 1 else f"{rank_list(rs)}: {text}" for text, rs in at.items())
    return f" (it returned, but its work never completed; {said})"


# Frames of a rank blocked on the rendezvous or the store: the evidence for the endpoint hint.
_RENDEZVOUS_FRAMES = ("rendezvous", "TCPStore", "_store_based_barrier", "init_process_group", "PrefixStore",
                      "_create_c10d_store", "store.wait", "store.get")


def find_startup_hang(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    """Ranks that never got past start-up when distcheck ended the run. At --timeout that is no hang: the run was
    cut during start-up (a slow import on a loaded node), said as such. Otherwise a hang, whose hint names the
    rendezvous only where a starting rank's stack shows it waiting there."""
    if not EndReason.of(facts.end_reason).by_distcheck:
        return []
    starting = sorted(r for r in range(facts.world_size) if r not in facts.records_lost and _starting(outcomes.get(r)))
    if not starting:
        return []
    ready = sorted(set(range(facts.world_size)) - set(starting))
    details = tuple(RankDetail(rank=r, role="absent", note=_starting_where(outcomes.get(r))) for r in starting)
    where = "; ".join(f"rank {d.rank} {d.note}" for d in details)
    blocked = [r for r in starting if _at_rendezvous(outcomes.get(r))]
    hint = (f" {rank_list(blocked).capitalize()} waited on the rendezvous: check that every rank can reach the "
            f"rendezvous endpoint." if blocked else "")
    if facts.end_reason == EndReason.TIMEOUT:
        limit = f" ({facts.timeout_s:g} s)" if facts.timeout_s else ""
        return [Finding(kind=Kind.COVERAGE, severity=Severity.WARNING, odd_ranks=tuple(starting), ranks=details,
                        data={"during_startup": True},
                        summary=(f"The run reached --timeout{limit} during start-up: {rank_list(starting)} "
                                 f"{'was' if len(starting) == 1 else 'were'} still starting ({where}). Nothing was "
                                 f"checked." + (hint or " Give it a longer --timeout.")))]
    return [Finding(
        kind=Kind.HANG, severity=Severity.ERROR, op="init_process_group", waiting_ranks=tuple(ready),
        absent_ranks=tuple(starting), ranks=details,
        summary=(f"{rank_list(starting).capitalize()} never finished start-up ({where}); "
                 f"{rank_list(ready)} got past it.{hint}"),
    )]


def _starting(o: RankOutcome | None) -> bool:
    """Not past start-up: never reported, still starting, or running a script that never got a process group."""
    return (o is None or o.phase in (None, Phase.STARTING)
            or (o.phase == Phase.RUNNING and o.pg_initialized is False and o.last_event is None))


def _at_rendezvous(o: RankOutcome | None) -> bool:
    return o is not None and any(frame in (o.stack or "") for frame in _RENDEZVOUS_FRAMES)


def _starting_where(o: RankOutcome | None) -> str:
    """Where a rank still starting up was: on the rendezvous, or importing (its stack's line)."""
    if o is None:
        return "never started"
    if _at_rendezvous(o):
        return "waiting on the rendezvous in init_process_group"
    return f"importing or starting, at {site(o.where)}" if o.where else "importing or starting up"


# States of a rank that had not finished when the run was cut.
_UNFINISHED = (RankState.RUNNING, RankState.STUCK, RankState.KILLED)


def find_timeout(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    """What was left open when --timeout cut a run (shown where no crash or other hang finding explains it).

    Only a rank inside a collective is *waiting*; the other members of that call are
    *absent* with their whereabouts (finished, or busy in user code), as a stall report
    says it. Unfinished ranks outside every open call are absent from nothing: they get
    one finding of their own, never a "waiting" role.
    """
    if facts.end_reason != EndReason.TIMEOUT:
        return []
    limit = f" of {facts.timeout_s:g} s" if facts.timeout_s else ""
    prefix = f"The run did not finish within its --timeout{limit}"
    findings = [_timed_out_in(call, present, facts.world_size, outcomes, prefix)
                for call, present in sorted(_open_calls(outcomes).items())]
    named = {r for f in findings for r in f.waiting_ranks + f.absent_ranks}
    rest = sorted(r for r, o in outcomes.items() if o.state in _UNFINISHED and r not in named)
    if rest or not findings:
        findings.append(_timed_out_outside(rest, outcomes, prefix))
    return findings


def _open_calls(outcomes: Mapping[int, RankOutcome]) -> dict[tuple[GroupKey, int], dict[int, Event]]:
    """{(group, seq): {rank: event}} of the collectives ranks were stuck in at the end."""
    calls: dict[tuple[GroupKey, int], dict[int, Event]] = defaultdict(dict)
    for r, o in sorted(outcomes.items()):
        if o.state == RankState.STUCK and o.last_event is not None:
            calls[(o.last_event.group, o.last_event.seq)][r] = o.last_event
    return calls


def _timed_out_in(call: tuple[GroupKey, int], present: Mapping[int, Event], world_size: int,
                  outcomes: Mapping[int, RankOutcome], prefix: str) -> Finding:
    """The stall report's hang finding for one open call, said as a timeout."""
    group, seq = call
    members = next(iter(present.values())).group_ranks or tuple(range(world_size))
    absent = sorted(set(members) - set(present))
    found = _hang_finding(group, seq, present, absent, outcomes, {}, None)
    return dataclasses.replace(found, summary=f"{prefix}: {found.summary[0].lower()}{found.summary[1:]}")


def _timed_out_outside(rest: list[int], outcomes: Mapping[int, RankOutcome], prefix: str) -> Finding:
    """Unfinished ranks that were in no collective: busy in user code, so absent and not waiting."""
    done = sorted(r for r, o in outcomes.items() if o.state == RankState.FINISHED)
    parts = [f"rank {r} {whereabouts(r, outcomes[r])}" for r in rest]
    parts += [f"{rank_list(done)} finished"] if done else []
    said = f": {'; '.join(parts)}" if parts else ""
    return Finding(
        kind=Kind.HANG, severity=Severity.ERROR, summary=f"{prefix} and no rank was waiting in a collective{said}.",
        absent_ranks=tuple(rest),
        ranks=tuple(RankDetail(rank=r, role="absent", state=outcomes[r].state, where=outcomes[r].where,
                               note=whereabouts(r, outcomes[r])) for r in rest),
    )
