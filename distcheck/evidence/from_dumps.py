"""Post-mortem of Flight Recorder dumps (one file per rank, pickle or JSON):
one ``ScenarioResult`` through the same ``verdict`` as a live run. File order
never matters: every rank is keyed by its number.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcheck.diagnose.rules import RunFacts
from distcheck.diagnose.rank_state import classify_rank
from distcheck.diagnose.verdict import Blame, Evidence, Scenario, scenario_result
from distcheck.errors import CorruptInputError, UsageError
from distcheck.files.flight_recorder import (CANNOT_TELL, Dump, EntryEnd, Membership, Reached, entry_end, load_dump,
                                             membership, never_entered, op_name, reached, to_events)
from distcheck.models import EndReason, Event, Phase, RankOutcome, RankState, ScenarioResult
from distcheck.text import rank_list

FR_SCENARIO = "flight-recorder"


@dataclass(frozen=True)
class _Ranks:
    """Which ranks the dumps cover, out of the world."""

    world: tuple[int, ...]
    present: tuple[int, ...]
    missing: tuple[int, ...]      # left no dump
    cut_short: tuple[int, ...]    # left a dump that is cut short


def analyze_dumps(files: Sequence[Path], world_size: int | None = None) -> tuple[ScenarioResult, dict[str, Any]]:
    """One verdict over a set of dumps, and what the report header needs from them."""
    t0 = time.time()
    dumps, notes = _load(files)
    ranks = _ranks(dumps, world_size)
    ordered = [dumps[r] for r in ranks.present]
    members, usable, seen = _matching(ordered, ranks.cut_short)
    early = _dumped_early(usable, members, seen)
    if early:   # they are compared only as far as their dumps go, as a cut-short one is
        ranks = dataclasses.replace(ranks, cut_short=tuple(sorted({*ranks.cut_short, *early})))
        members, usable, seen = _matching(ordered, ranks.cut_short)
    traces = {d.rank: to_events(d, members, seen) for d in ordered}
    traces, renumbered = _close_gaps(traces, {d.rank for d in ordered if d.wrapped})
    outcomes = {r: _fr_outcome(r, events) for r, events in traces.items()}
    # A cut-short rank's calls stop where its file stops: matched, they would make
    # it look like a rank that never came. Its outcome still shows what was read.
    matched = {r: events for r, events in traces.items() if r not in ranks.cut_short}
    stuck = any(o.state == RankState.STUCK for o in outcomes.values())
    events = [e for evs in traces.values() for e in evs]
    evidence = Evidence(
        events=matched, outcomes=outcomes,
        # a post-mortem: no launch, no expectation, no stall timeout ran; the dumps say what they say
        facts=RunFacts(world_size=len(ranks.world), end_reason=EndReason.POSTMORTEM if stuck else EndReason.COMPLETED),
        started_at=min((e.t_enter for e in events if e.t_enter), default=None),
        ended_at=max((e.t_exit or e.t_enter for e in events), default=None))
    notes[:0] = _dump_notes(ordered, ranks.missing, len(ranks.world), world_size is not None, members.inferred,
                            renumbered) + _early_notes(early) + _unfinished_notes(usable, members, seen)
    backends = set().union(*(d.backends for d in ordered))
    scenario = Scenario(name=FR_SCENARIO, source=str(common_dir(list(files))),
                        description=_description(ordered, backends, ranks, notes))
    result = scenario_result(scenario, evidence, 0.0, Blame(ranks.missing, ranks.cut_short))
    # The analysis itself is part of a post-mortem's duration; it expected nothing (said as a script's verdict).
    result = dataclasses.replace(result, duration_s=time.time() - t0, script=True)
    return result, {"backends": backends, "versions": _versions(ordered), "world_size": len(ranks.world),
                    "events": traces}


def _matching(ordered: list[Dump], cut_short: tuple[int, ...]) -> tuple[Membership, list[Dump], Reached]:
    """Who is matched: ranks with no dump, or a cut-short one, are no group's members
    (what they did after their last readable entry is unknown, not "never came")."""
    members = membership(ordered, tuple(d.rank for d in ordered if d.rank not in cut_short))
    usable = [d for d in ordered if d.rank not in cut_short]
    return members, usable, reached(usable)


def _dumped_early(dumps: list[Dump], members: Membership, seen: Reached) -> dict[int, str]:
    """Ranks whose dump was taken before they entered a call a peer completed (its end event fired,
    which needs every member): what they did after their dump is unknown, not a call they never made.
    Said of them from the peer's completed call, never as records lost."""
    early: dict[int, str] = {}
    for d in dumps:
        for e in d.entries:
            if entry_end(e) != EntryEnd.COMPLETED:
                continue
            for m in never_entered(d, e, members, seen):
                early.setdefault(m, f"rank {d.rank} completed {_call(e)}")
    return early


def _early_notes(early: dict[int, str]) -> list[str]:
    return [f"rank {r}: its dump was taken before it entered a call its peers finished ({why}, which needs "
            f"every member): it is compared only as far as its dump goes, as a dump cut short is."
            for r, why in sorted(early.items())]


def _load(files: Sequence[Path]) -> tuple[dict[int, Dump], list[str]]:
    """Every readable dump by rank, and a note for each one left out."""
    dumps: dict[int, Dump] = {}
    for path in files:
        dump = load_dump(path)
        if dump.rank in dumps:
            raise UsageError(f"two dumps for rank {dump.rank}: {dumps[dump.rank].path} and {path}",
                             "analyze one dump per rank (the pickle or the JSON form, not both)")
        dumps[dump.rank] = dump
    notes: list[str] = []
    unreadable = sorted(r for r, d in dumps.items() if d.truncated and not d.entries)
    for r in unreadable:
        notes.append(f"rank {r}: {dumps[r].path.name} is cut short before its first entry; nothing of it is used.")
        del dumps[r]
    if not dumps:
        raise CorruptInputError("none of the dumps holds a readable entry", "check that the files are complete")
    return dumps, notes


def _ranks(dumps: dict[int, Dump], world_size: int | None) -> _Ranks:
    named = {r for d in dumps.values() for ranks in d.pg_ranks.values() for r in ranks}
    if world_size is not None:
        if world_size < 1 or max(dumps) >= world_size:
            raise UsageError(f"--world-size {world_size} does not fit the dumps "
                             f"(they come from ranks up to {max(dumps)})")
        world = tuple(range(world_size))
    else:
        world = tuple(range(max([*dumps, *named]) + 1))
    present = tuple(sorted(dumps))
    return _Ranks(world=world, present=present, missing=tuple(r for r in world if r not in dumps),
                  cut_short=tuple(r for r in present if dumps[r].truncated))


def _description(ordered: list[Dump], backends: set[str], ranks: _Ranks, notes: list[str]) -> str:
    forms = sorted({d.form for d in ordered})
    return (f"Flight Recorder dumps ({'/'.join(sorted(backends)) or 'unknown backend'}, "
            f"{' and '.join(forms)} form) of {len(ranks.present)} of {len(ranks.world)} ranks.\n" + "\n".join(notes))


def _versions(ordered: list[Dump]) -> dict[str, str]:
    versions = {"flight_recorder": ",".join(sorted({d.version for d in ordered if d.version})) or "unknown"}
    libs = sorted({d.comm_lib_version for d in ordered if d.comm_lib_version})
    if libs:
        versions["comm_lib"] = ",".join(libs)
    return versions


def common_dir(paths: Sequence[Path]) -> Path:
    """The deepest directory holding every path (the paths themselves, if directories)."""
    dirs = [str(p.resolve() if p.is_dir() else p.resolve().parent) for p in paths]
    return Path(os.path.commonpath(dirs)) if dirs else Path.cwd()


def _fr_outcome(rank: int, events: list[Event]) -> RankOutcome:
    """A rank whose earliest unfinished entry exists is waiting there; otherwise it
    was past its last recorded collective when it dumped (where exactly: unknown)."""
    waiting = next((e for e in events if not e.completed), None)
    state, where = classify_rank(Phase.RUNNING, waiting, None, None, primary=False)
    return RankOutcome(rank=rank, state=state, collectives=len(events),
                       last_event=waiting or (events[-1] if events else None), where=where, phase=Phase.RUNNING)


def _close_gaps(traces: dict[int, list[Event]], wrapped: set[int]) -> tuple[dict[int, list[Event]], list[str]]:
    """Make each group's sequence numbers dense across ranks, and cut groups to the
    window every wrapped buffer still covers.

    The ids stay aligned across ranks but may have gaps (gloo's monitored_barrier
    uses two ids it never records); the analysis looks for the call after the
    last one a rank reached, so a gap there would hide a hang.
    """
    seqs: dict[str, set[int]] = defaultdict(set)
    low: dict[str, int] = {}
    for rank, events in traces.items():
        by_group: dict[str, list[int]] = defaultdict(list)
        for e in events:
            if not e.is_p2p:
                seqs[e.group].add(e.seq)
                by_group[e.group].append(e.seq)
        if rank in wrapped:
            for g, ss in by_group.items():
                low[g] = max(low.get(g, 0), min(ss))
    notes = []
    mapping: dict[str, dict[int, int]] = {}
    for g, ids in seqs.items():
        kept = sorted(s for s in ids if s >= low.get(g, 0))
        if low.get(g) and min(ids) < low[g]:
            notes.append(f"group {g}: a rank's buffer overflowed; only collectives from #{low[g]} on are compared.")
        if kept and kept[-1] - kept[0] + 1 != len(kept):
            mapping[g] = {s: kept[0] + i for i, s in enumerate(kept)}
            skipped = kept[-1] - kept[0] + 1 - len(kept)
            notes.append(f"group {g}: {skipped} collective_seq_id(s) never appear in any dump (gloo's "
                         f"monitored_barrier uses ids it does not record); numbers here close that gap, so "
                         f"#{mapping[g][kept[-1]]} is the dumps' collective_seq_id {kept[-1]}.")
    out: dict[int, list[Event]] = {}
    for rank, events in traces.items():
        kept_events = []
        for e in events:
            if not e.is_p2p and e.seq < low.get(e.group, 0):
                continue
            if e.group in mapping:
                e = e._replace(seq=mapping[e.group][e.seq])
            kept_events.append(e)
        out[rank] = kept_events
    return out, notes


def _dump_notes(dumps: list[Dump], missing: tuple[int, ...], world: int, world_given: bool,
                inferred: tuple[str, ...], renumbered: list[str]) -> list[str]:
    notes = []
    if missing:
        notes.append(f"{rank_list(missing).capitalize()} left no dump: where {'it' if len(missing) == 1 else 'they'} "
                     f"stood cannot be told, so {'it is' if len(missing) == 1 else 'they are'} left out of the "
                     f"matching.")
    if not world_given:
        notes.append(f"World size taken as {world} from the file names (dumps do not record it; "
                     f"a missing highest rank goes unnoticed — pass --world-size).")
    for d in dumps:
        if d.truncated:
            notes.append(f"rank {d.rank}: {d.path.name} is cut short after {len(d.entries)} whole entries; what the "
                         f"rank did after them is unknown, so it is left out of the matching.")
        if d.skipped_entries:
            notes.append(f"rank {d.rank}: {d.skipped_entries} entries lack a process group or sequence number "
                         f"and are skipped.")
        if not d.entries:
            notes.append(f"rank {d.rank}: the dump holds no entry (no collective recorded, or "
                         f"TORCH_FR_BUFFER_SIZE was not set on that rank).")
    if inferred:
        notes.append(f"Members of {', '.join(inferred)} are inferred from which dumps mention "
                     f"{'it' if len(inferred) == 1 else 'them'} (gloo dumps do not record group members).")
    notes.extend(renumbered)
    if any(d.form == "json" for d in dumps):
        notes.append("JSON dumps carry no Python frames: call sites are unknown there (the pickle form has them).")
    if any(d.backends & {"gloo"} for d in dumps):
        notes.append("gloo records no send/recv, and marks an entry done (retired) when it finished "
                     "with or without error: a retired call counts as completed only where every member "
                     "with a dump entered it.")
    notes.append(f"A dump is a snapshot: a collective in flight when it was taken looks like a wait. Dumps do not "
                 f"record the {', '.join(CANNOT_TELL)}, so those are not compared.")
    return notes


def _unfinished_notes(dumps: list[Dump], members: Membership, seen: Reached) -> list[str]:
    """One note per rank whose dump shows calls that ended without finishing: the first, and how many."""
    notes = []
    for d in dumps:
        said = []
        for e in d.entries:
            end = entry_end(e)
            absent = never_entered(d, e, members, seen) if end == EntryEnd.ENDED else ()
            if end == EntryEnd.FAILED:
                said.append(f"{_call(e)} was retired without its end event: it did not finish (an error, a "
                            f"time-out or an abort)")
            elif absent:
                said.append(f"{_call(e)} was retired while {rank_list(absent)} never entered it: it cannot have "
                            f"completed, so it ended in an error (a time-out, or a peer that exited)")
        if said:
            more = f" ({len(said) - 1} more such call(s) after it)" if len(said) > 1 else ""
            notes.append(f"rank {d.rank}: {said[0]}{more}; counted as a wait, not a completed call.")
    return notes


def _call(e: dict[str, Any]) -> str:
    group = e.get("process_group")
    where = f" on group {group[0]}" if isinstance(group, (list, tuple)) and group else ""
    return f"{op_name(e.get('profiling_name', ''))[0]} (collective_seq_id {e.get('collective_seq_id')}){where}"

