"""Pure analysis: per-rank events + rank outcomes → findings.

No I/O, no printing, no process groups. Calls are matched by (group, sequence
number); what was *expected* at a sequence number is decided by majority, and
a tie is stated as a tie — never "whichever rank file was read first".
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from distcheck.models import Event, Finding, RankDetail, RankOutcome
from distcheck.text import field_value, plural, rank_list, site

COMPARED_FIELDS = ("op", "reduce_op", "shapes", "dtypes", "device", "root")
MAX_REPORTED_PER_GROUP = 5
ABNORMAL_ENDS = ("stall", "timeout", "crash", "interrupted")

GroupKey = tuple[str, tuple[int, ...]]   # (group name, member ranks)


@dataclass(frozen=True)
class RunFacts:
    """What the launcher knows about how the run ended."""

    world_size: int
    end_reason: str = "completed"        # completed, stall, crash, timeout, max_duration, interrupted
    stall_onset: float | None = None     # wall time of the last progress
    detected_at: float | None = None     # wall time the stall was declared
    timeout_s: float | None = None
    straggler_min_lag_s: float = 0.1


# -- matching ---------------------------------------------------------------


def group_table(traces: Mapping[int, Sequence[Event]]) -> dict[GroupKey, dict[int, dict[int, Event]]]:
    """{(group, members): {seq: {rank: event}}} over every rank's events."""
    table: dict[GroupKey, dict[int, dict[int, Event]]] = defaultdict(lambda: defaultdict(dict))
    for rank, events in traces.items():
        for e in events:
            members = e.group_ranks or (rank,)
            table[(e.group, members)][e.seq][rank] = e
    return table


def _signature(e: Event) -> tuple:
    return tuple(getattr(e, f) for f in COMPARED_FIELDS)


def majority(values: Mapping[int, Any]) -> tuple[Any, list[int], bool]:
    """(majority value, odd ranks, tie) over rank → value. On a tie there is no odd side."""
    counts = Counter(values.values())
    ranked = counts.most_common()
    top_value, top_count = ranked[0]
    tie = len(ranked) > 1 and ranked[1][1] == top_count
    if tie:
        return None, [], True
    odd = sorted(r for r, v in values.items() if v != top_value)
    return top_value, odd, False


def _detail(rank: int, role: str, e: Event | None, **extra: Any) -> RankDetail:
    if e is None:
        return RankDetail(rank=rank, role=role, **extra)
    return RankDetail(rank=rank, role=role, op=e.op, seq=e.seq, label=e.label, callsite=e.callsite,
                      fingerprint=e.fingerprint(), **extra)


def _who(e: Event) -> str:
    label = f"{e.label} " if e.label else ""
    return f"{label}at {site(e.callsite)}"


# -- structural mismatch and crossed calls ---------------------------------


def find_mismatches(table: Mapping[GroupKey, Mapping[int, Mapping[int, Event]]]) -> list[Finding]:
    findings: list[Finding] = []
    for (group, members), seqs in sorted(table.items()):
        if group.startswith("p2p:"):
            continue
        reported: set[tuple] = set()
        for seq in sorted(seqs):
            events = seqs[seq]
            if len(events) < 2:
                continue
            finding = _mismatch_at(group, members, seq, events) or _crossing_at(group, members, seq, events)
            if finding is None:
                continue
            key = (finding.kind, finding.fields, finding.odd_ranks, finding.tie)
            if key in reported:
                continue
            reported.add(key)
            findings.append(finding)
            if len(reported) >= MAX_REPORTED_PER_GROUP:
                break
    return findings


def _mismatch_at(group: str, members: tuple[int, ...], seq: int, events: Mapping[int, Event]) -> Finding | None:
    sigs = {r: _signature(e) for r, e in events.items()}
    if len(set(sigs.values())) == 1:
        return None
    expected, odd, tie = majority(sigs)
    if tie:
        distinct = list(dict.fromkeys(sigs.values()))
        fields = tuple(f for i, f in enumerate(COMPARED_FIELDS) if len({s[i] for s in distinct}) > 1)
        ref = None
    else:
        fields = tuple(f for i, f in enumerate(COMPARED_FIELDS)
                       if any(sigs[r][i] != expected[i] for r in odd))
        ref = next(e for r, e in events.items() if sigs[r] == expected)
    sample = ref or events[min(events)]
    details = tuple(_detail(r, "odd" if r in odd else ("tie" if tie else "majority"), e)
                    for r, e in sorted(events.items()))
    summary = _mismatch_summary(seq, group, fields, events, ref, odd, tie)
    return Finding(
        kind="mismatch", severity="error", summary=summary, group=group, seq=seq, op=sample.op,
        label=sample.label, callsite=sample.callsite, odd_ranks=tuple(odd), fields=fields,
        majority=ref.fingerprint() if ref else None, tie=tie, ranks=details,
    )


def _mismatch_summary(seq, group, fields, events, ref, odd, tie) -> str:
    parts = []
    for f in fields:
        values: dict[str, list[int]] = defaultdict(list)
        for r, e in sorted(events.items()):
            values[field_value(f, getattr(e, f))].append(r)
        parts.append(f"{f} " + " vs ".join(f"{v} ({rank_list(rs)})" for v, rs in values.items()))
    where = "; ".join(parts)
    if tie:
        sites = "; ".join(f"{rank_list([r])}: {_who(e)}" for r, e in sorted(events.items()))
        return (f"Collective #{seq} on group {group}: ranks disagree and no side has a majority (tie): "
                f"{where}. Calls: {sites}.")
    odd_e = events[odd[0]]
    return (f"Collective #{seq} on group {group} ({ref.op}): {rank_list(odd)} called it with a different "
            f"{' and '.join(fields)} than the majority — {where}. Majority: {_who(ref)}; "
            f"odd: {_who(odd_e)}.")


def _crossing_at(group: str, members: tuple[int, ...], seq: int, events: Mapping[int, Event]) -> Finding | None:
    labels = {r: e.label for r, e in events.items()}
    if len(set(labels.values())) == 1:
        return None
    expected, odd, tie = majority(labels)
    details = tuple(_detail(r, "odd" if r in odd else ("tie" if tie else "majority"), e)
                    for r, e in sorted(events.items()))
    sample = events[min(events)]
    by_label: dict[str, list[int]] = defaultdict(list)
    for r, label in sorted(labels.items()):
        by_label[label or "(no module)"].append(r)
    sides = " meets ".join(f"{label} on {rank_list(rs)}" for label, rs in by_label.items())
    summary = (f"Crossed calls at collective #{seq} on group {group} ({sample.op}): {sides}. The signatures "
               f"match, so the backend pairs them silently and the values are exchanged between different "
               f"metrics/modules. Call them in the same order on every rank.")
    majority_event = next((e for r, e in events.items() if not tie and labels[r] == expected), None)
    return Finding(
        kind="order", severity="error", summary=summary, group=group, seq=seq, op=sample.op,
        label=majority_event.label if majority_event else None,
        callsite=majority_event.callsite if majority_event else None,
        odd_ranks=tuple(odd), fields=("label",), tie=tie,
        majority=majority_event.fingerprint() | {"label": majority_event.label} if majority_event else None,
        ranks=details,
    )


# -- hangs, crashes, counts -------------------------------------------------


def _whereabouts(rank: int, outcome: RankOutcome | None) -> str:
    if outcome is None:
        return "never started"
    if outcome.state == "finished":
        return "finished, now idle"
    if outcome.state == "crashed":
        cause = outcome.exception or (f"killed by {outcome.signal}" if outcome.signal else f"exit code {outcome.exit_code}")
        return f"crashed ({cause})"
    if outcome.state == "stuck" and outcome.last_event is not None:
        e = outcome.last_event
        return f"waiting in {e.op} #{e.seq} (group {e.group}) {_who(e)}"
    if outcome.phase == "starting":
        return "still starting up (init_process_group)"
    if outcome.where:
        return f"running outside any collective at {site(outcome.where)}"
    return outcome.state


def find_hangs(table, outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    if facts.end_reason not in ABNORMAL_ENDS:
        return []
    detected_after = None
    if facts.stall_onset is not None and facts.detected_at is not None:
        detected_after = round(facts.detected_at - facts.stall_onset, 3)
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if len(members) < 2:
            continue
        reached = {m: max((s for s, ev in seqs.items() if m in ev), default=0) for m in members}
        if len(set(reached.values())) > 1:
            first_missing = min(reached.values()) + 1
            present = seqs.get(first_missing, {})
            waiting = sorted(present)
            absent = sorted(m for m in members if m not in present)
        else:
            last = max(reached.values())
            present = seqs.get(last, {})
            if not present or all(e.completed for e in present.values()):
                continue
            first_missing, waiting, absent = last, sorted(present), []
        if not waiting:
            continue
        findings.append(_hang_finding(group, first_missing, present, waiting, absent, outcomes, detected_after))
    return findings


def _hang_finding(group, seq, present, waiting, absent, outcomes, detected_after) -> Finding:
    ops = Counter(e.op for e in present.values())
    op = ops.most_common(1)[0][0]
    ref = next(e for e in present.values() if e.op == op)
    details = [_detail(r, "waiting", present[r], state=outcomes[r].state if r in outcomes else None)
               for r in waiting]
    details += [RankDetail(rank=r, role="absent", state=outcomes[r].state if r in outcomes else None,
                           where=outcomes[r].where if r in outcomes else None,
                           note=_whereabouts(r, outcomes.get(r))) for r in absent]
    verb = "is" if len(waiting) == 1 else "are"
    summary = f"{rank_list(waiting).capitalize()} {verb} waiting in {op} #{seq} (group {group}) called from {_who(ref)}"
    if absent:
        groups: dict[str, list[int]] = defaultdict(list)
        for r in absent:
            groups[_whereabouts(r, outcomes.get(r))].append(r)
        summary += "; " + "; ".join(f"{rank_list(rs)} never entered it ({where})" for where, rs in groups.items())
        summary += ". Every rank must issue the same collectives in the same order: call it on all ranks."
    else:
        summary += "; every rank entered it but it never completed (a mismatch or a backend/network fault)."
    return Finding(
        kind="hang", severity="error", summary=summary, group=group, seq=seq, op=op, label=ref.label,
        callsite=ref.callsite, waiting_ranks=tuple(waiting), absent_ranks=tuple(absent),
        detected_after_s=detected_after, ranks=tuple(details),
    )


def find_startup_hang(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    if facts.end_reason not in ("stall", "timeout"):
        return []
    starting = sorted(r for r in range(facts.world_size)
                      if r not in outcomes or outcomes[r].phase in (None, "starting"))
    if not starting:
        return []
    ready = sorted(set(range(facts.world_size)) - set(starting))
    return [Finding(
        kind="hang", severity="error", op="init_process_group", waiting_ranks=tuple(ready),
        absent_ranks=tuple(starting),
        summary=(f"{rank_list(starting).capitalize()} never finished start-up (importing or init_process_group); "
                 f"{rank_list(ready)} got past it. Check that every rank can reach the rendezvous endpoint."),
        ranks=tuple(RankDetail(rank=r, role="absent", note=_whereabouts(r, outcomes.get(r))) for r in starting),
    )]


def find_timeout(outcomes: Mapping[int, RankOutcome], facts: RunFacts, already: list[Finding]) -> list[Finding]:
    if facts.end_reason != "timeout" or already:
        return []
    running = sorted(r for r, o in outcomes.items() if o.state in ("running", "stuck", "killed"))
    limit = f" of {facts.timeout_s:g} s" if facts.timeout_s else ""
    return [Finding(
        kind="hang", severity="error", waiting_ranks=tuple(running),
        summary=(f"The run did not finish within its --timeout{limit}: "
                 + "; ".join(f"rank {r} {_whereabouts(r, outcomes[r])}" for r in running) + "."),
        ranks=tuple(RankDetail(rank=r, role="running", where=outcomes[r].where,
                               note=_whereabouts(r, outcomes[r])) for r in running),
    )]


def find_crashes(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    crashed = [o for _, o in sorted(outcomes.items()) if o.state == "crashed"]
    if not crashed:
        return []
    # A Python exception is the clearest root cause; then signals; then bare exit codes.
    root = sorted(crashed, key=lambda o: (o.exception is None, o.signal is None, o.rank))[0]
    cause = root.exception or (f"was killed by {root.signal}" if root.signal else f"exited with code {root.exit_code}")
    where = f" at {site(root.where)}" if root.where else ""
    others = sorted(r for r in outcomes if r != root.rank)
    details = [RankDetail(rank=o.rank, role="crashed", state=o.state, where=o.where,
                          note=o.exception or o.signal or f"exit code {o.exit_code}") for o in crashed]
    details += [RankDetail(rank=r, role="peer", state=outcomes[r].state, where=outcomes[r].where,
                           note=_whereabouts(r, outcomes[r])) for r in others if outcomes[r].state != "crashed"]
    text_cause = f"raised {cause}" if root.exception else cause
    summary = f"Rank {root.rank} {text_cause}{where}"
    rest = [d for d in details if d.role == "peer"]
    if rest:
        groups: dict[str, list[int]] = defaultdict(list)
        for d in rest:
            groups[d.note or "?"].append(d.rank)
        summary += "; meanwhile " + "; ".join(f"{rank_list(rs)} {where_}" for where_, rs in groups.items())
    more = [o.rank for o in crashed if o.rank != root.rank]
    if more:
        summary += f"; {rank_list(more)} failed too"
    last = root.last_event
    return [Finding(
        kind="crash", severity="error", summary=summary + ".", op=last.op if last else None,
        group=last.group if last else None, seq=last.seq if last else None,
        label=last.label if last else None, callsite=root.where, odd_ranks=(root.rank,),
        ranks=tuple(details), data={"root_rank": root.rank, "exception": root.exception, "signal": root.signal,
                                    "exit_code": root.exit_code},
    )]


def find_count_differences(table, facts: RunFacts, explained: bool) -> list[Finding]:
    if explained or facts.end_reason == "max_duration":
        return []
    findings = []
    for (group, members), seqs in sorted(table.items()):
        counts = {m: sum(1 for ev in seqs.values() if m in ev) for m in members}
        if len(set(counts.values())) <= 1:
            continue
        expected, odd, tie = majority(counts)
        by_count: dict[int, list[int]] = defaultdict(list)
        for r, c in sorted(counts.items()):
            by_count[c].append(r)
        sides = ", ".join(f"{rank_list(rs)} issued {c}" for c, rs in sorted(by_count.items()))
        findings.append(Finding(
            kind="count", severity="error", group=group, odd_ranks=tuple(odd), tie=tie, fields=("count",),
            majority={"count": expected} if not tie else None,
            summary=f"Ranks issued different numbers of collectives on group {group}: {sides}.",
            data={"counts": {str(r): c for r, c in counts.items()}},
        ))
    return findings


# -- wrong numbers ------------------------------------------------------------


def find_numeric(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    by_name: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for check in res.get("numeric_checks", ()):
            by_name[check["name"]][rank] = check
    findings = []
    for name, checks in by_name.items():
        bad = {r: c for r, c in checks.items() if not c["ok"]}
        if not bad:
            continue
        first = bad[min(bad)]
        differing = first["differing"]
        entries = "; ".join(
            f"{_index(d['index'])}: {_num(d['actual'])} instead of {_num(d['reference'])}" for d in differing[:8])
        n = len(differing)
        total = math.prod(first["shape"]) if first["shape"] else 1
        summary = (f"{name!r} differs from the single-process reference on {rank_list(bad)}: "
                   f"{plural(n, 'entry', 'entries')} of {total} off (max |diff| {_num(first['max_abs_diff'])})"
                   + (f" — {entries}" if entries else "") + ".")
        if first.get("note"):
            summary += f" {first['note']}"
        findings.append(Finding(
            kind="numeric", severity="error", summary=summary, odd_ranks=tuple(sorted(bad)),
            data={"check": name, "ranks": sorted(bad), "max_abs_diff": first["max_abs_diff"],
                  "differing": differing, "actual": first.get("actual"), "reference": first.get("reference")},
        ))
    return findings


def _index(idx: Any) -> str:
    if idx in (None, []):
        return "value"
    return "[" + ", ".join(map(str, idx)) + "]"


def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def find_duplicates(results: Mapping[int, Mapping[str, Any]], world_size: int) -> list[Finding]:
    per_dataset: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, int] = {}
    for rank, res in sorted(results.items()):
        for rec in res.get("samples", ()):
            per_dataset[rec["dataset"]][rank].extend(rec["ids"])
            sizes[rec["dataset"]] = rec["dataset_size"]
    findings = []
    for dataset, by_rank in per_dataset.items():
        f = _sample_finding(dataset, sizes[dataset], by_rank, world_size)
        if f is not None:
            findings.append(f)
    return findings


def sample_accounting(size: int, by_rank: Mapping[int, Sequence[int]]) -> dict[str, Any]:
    counts = Counter(i for ids in by_rank.values() for i in ids)
    seen_by: dict[int, list[int]] = defaultdict(list)
    for r, ids in sorted(by_rank.items()):
        for i in ids:
            seen_by[i].append(r)
    duplicated = {i: seen_by[i] for i, c in sorted(counts.items()) if c > 1}
    missing = sorted(set(range(size)) - set(counts))
    return {"counts": counts, "duplicated": duplicated, "missing": missing,
            "total": sum(counts.values())}


def _sample_finding(dataset: str, size: int, by_rank: Mapping[int, Sequence[int]], world_size: int) -> Finding | None:
    acc = sample_accounting(size, by_rank)
    duplicated, missing, total = acc["duplicated"], acc["missing"], acc["total"]
    if not duplicated and not missing:
        return None
    ranks = sorted(by_rank)
    same_everywhere = len(ranks) > 1 and len({tuple(sorted(by_rank[r])) for r in ranks}) == 1
    extra = total - (size - len(missing))
    padded_to = math.ceil(size / max(len(ranks), 1)) * len(ranks)
    if same_everywhere:
        cause = (f"every rank evaluated the same {plural(len(by_rank[ranks[0]]), 'sample')}: the evaluation data "
                 f"is not sharded, so each sample is counted {len(ranks)} times")
    elif not missing and total == padded_to and padded_to > size:
        cause = (f"DistributedSampler padded {size} samples to {padded_to} for {len(ranks)} ranks by repeating "
                 f"{plural(padded_to - size, 'sample')}; use drop_last or an unpadded sampler for evaluation")
    else:
        cause = "the ranks' shards overlap" if duplicated else "the ranks' shards do not cover the dataset"
    parts = []
    if duplicated:
        shown = ", ".join(f"{i} (ranks {', '.join(map(str, rs))})" for i, rs in list(duplicated.items())[:10])
        parts.append(f"{plural(len(duplicated), 'sample')} counted more than once ({extra} extra): ids {shown}")
    if missing:
        parts.append(f"{plural(len(missing), 'sample')} never seen: ids {', '.join(map(str, missing[:20]))}")
    summary = f"Dataset {dataset!r} ({size} samples): " + "; ".join(parts) + f" — {cause}."
    return Finding(
        kind="duplicates", severity="error", summary=summary,
        odd_ranks=tuple(sorted({r for rs in duplicated.values() for r in rs})),
        data={"dataset": dataset, "dataset_size": size, "duplicated": {str(i): rs for i, rs in duplicated.items()},
              "missing": missing, "extra": extra, "same_on_every_rank": same_everywhere,
              "per_rank": {str(r): sorted(ids) for r, ids in sorted(by_rank.items())}},
    )


# -- stragglers --------------------------------------------------------------


def find_stragglers(table, facts: RunFacts, min_collectives: int = 5, share: float = 0.8) -> list[Finding]:
    findings = []
    for (group, members), seqs in sorted(table.items()):
        if group.startswith("p2p:") or len(members) < 2:
            continue
        lags: dict[int, list[float]] = defaultdict(list)
        last_count: Counter = Counter()
        complete = 0
        for seq, events in seqs.items():
            if len(events) != len(members):
                continue
            complete += 1
            times = {r: e.t_enter for r, e in events.items()}
            first = min(times.values())
            latest = max(times, key=times.get)
            last_count[latest] += 1
            for r, t in times.items():
                lags[r].append(t - first)
        if complete < min_collectives:
            continue
        for rank, n_last in last_count.items():
            median_lag = statistics.median(lags[rank])
            if n_last >= share * complete and median_lag >= facts.straggler_min_lag_s:
                others = statistics.median(l for r, ls in lags.items() if r != rank for l in ls)
                findings.append(Finding(
                    kind="straggler", severity="warning", group=group, odd_ranks=(rank,),
                    summary=(f"Rank {rank} was the last to enter {n_last} of {complete} collectives on group "
                             f"{group}, a median {median_lag:.3f} s after the first rank (max {max(lags[rank]):.3f} s); "
                             f"every other rank waits for it each time."),
                    data={"rank": rank, "last_in": n_last, "collectives": complete,
                          "median_lag_s": round(median_lag, 4), "max_lag_s": round(max(lags[rank]), 4),
                          "others_median_lag_s": round(others, 4)},
                ))
    return findings


# -- entry point ----------------------------------------------------------------


def analyze(
    traces: Mapping[int, Sequence[Event]],
    outcomes: Mapping[int, RankOutcome],
    facts: RunFacts,
    results: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Every finding for one run, most important first."""
    table = group_table(traces)
    crashes = find_crashes(outcomes, facts)
    hangs = [] if crashes else find_hangs(table, outcomes, facts)
    hangs = hangs or ([] if crashes else find_startup_hang(outcomes, facts))
    mismatches = find_mismatches(table)
    counts = find_count_differences(table, facts, explained=bool(crashes or hangs or facts.end_reason in ABNORMAL_ENDS))
    timeout = find_timeout(outcomes, facts, crashes + hangs)
    results = results or {}
    findings = (crashes + hangs + timeout + mismatches + counts + find_numeric(results)
                + find_duplicates(results, facts.world_size) + find_stragglers(table, facts))
    return findings


def collectives_compared(traces: Mapping[int, Sequence[Event]]) -> int:
    """How many (group, seq) calls were seen on at least two ranks and compared."""
    table = group_table(traces)
    return sum(1 for seqs in table.values() for events in seqs.values() if len(events) >= 2)


def observed_kinds(findings: Iterable[Finding]) -> tuple[str, ...]:
    kinds = sorted({f.kind for f in findings if f.severity in ("error", "warning")})
    return tuple(kinds) or ("pass",)


def behaved_as_expected(expected: Sequence[str], observed: Sequence[str]) -> bool:
    """'pass' must see no finding at all; otherwise every expected kind must be observed."""
    if tuple(expected) == ("pass",):
        return tuple(observed) == ("pass",)
    return set(expected) <= set(observed)
