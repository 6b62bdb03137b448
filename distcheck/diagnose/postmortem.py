"""Post-mortem: turn Flight Recorder dumps or distcheck traces into a Report.

``distcheck analyze PATH...`` lands here. The paths are sorted into sources —
one set of Flight Recorder dumps (one file per rank, pickle or JSON), and any
number of distcheck launch directories (``traces/rank*.trace`` plus status and
stack files) — each becomes one ``ScenarioResult`` analysed by the very same
``distcheck.diagnose.rules.analyze`` as a live run. File order never matters: every
rank is keyed by its number and the expected call is decided by majority.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from distcheck import __version__
from distcheck.diagnose.rules import RunFacts, analyze, collectives_compared, observed_kinds, behaved_as_expected
from distcheck.errors import CorruptInputError, UsageError
from distcheck.files.flight_recorder import CANNOT_TELL, Dump, load_dump, membership, rank_from_name, sniff, to_events
from distcheck.models import Event, Finding, RankDetail, RankOutcome, Report, RunInfo, ScenarioResult
from distcheck.files.launch_dir import LaunchFiles, read_json
from distcheck.files.stacks import main_stack, parse_dumps, user_top
from distcheck.text import rank_list
from distcheck.files.trace import read_trace_dir

FR_SCENARIO = "flight-recorder"


@dataclass(frozen=True)
class PostMortem:
    """The report, and the events behind it (for timelines): scenario → rank → events."""

    report: Report
    events: dict[str, dict[int, list[Event]]]


@dataclass
class Sources:
    dumps: list[Path] = field(default_factory=list)            # Flight Recorder files
    launches: list[Path] = field(default_factory=list)         # dirs holding traces/


def find_sources(paths: Sequence[Path]) -> Sources:
    """Sort the given paths into dump files and distcheck launch directories."""
    if not paths:
        raise UsageError("nothing to analyze: give Flight Recorder dumps, a directory of them, or a distcheck run dir")
    found = Sources()
    for path in paths:
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        if path.is_file():
            if path.suffix == ".trace":
                _add(found.launches, path.parent.parent if path.parent.name == "traces" else path.parent)
            else:
                found.dumps.append(path)
            continue
        if (path / "traces").is_dir():
            _add(found.launches, path)
        elif any(path.glob("rank*.trace")):
            _add(found.launches, path.parent if path.name == "traces" else path)
        elif launches := sorted(p for p in path.iterdir() if (p / "traces").is_dir()):
            for launch in launches:
                _add(found.launches, launch)
        else:
            dumps = sorted(p for p in path.iterdir() if p.is_file() and _looks_like_dump(p))
            if not dumps:
                raise UsageError(f"{path}: no Flight Recorder dumps or distcheck traces in this directory",
                                 "give the dump files (PREFIX<rank>), their directory, or a distcheck run dir")
            found.dumps.extend(dumps)
    return found


def _add(items: list[Path], path: Path) -> None:
    if path.resolve() not in {p.resolve() for p in items}:
        items.append(path)


def _looks_like_dump(path: Path) -> bool:
    if rank_from_name(path) is None:
        return False
    try:
        with open(path, "rb") as f:
            return sniff(f.read(64)) is not None
    except OSError:
        return False


def analyze_paths(paths: Sequence[Path], world_size: int | None = None, command: str = "") -> PostMortem:
    """Everything the given paths say, as one Report."""
    started = time.time()
    sources = find_sources(paths)
    results: list[ScenarioResult] = []
    events: dict[str, dict[int, list[Event]]] = {}
    backends: set[str] = set()
    versions: dict[str, str] = {}
    world = 0
    if sources.dumps:
        result, info = analyze_dumps(sources.dumps, world_size)
        results.append(result)
        events[result.name] = info["events"]
        backends |= info["backends"]
        versions.update(info["versions"])
        world = max(world, info["world_size"])
    for launch in sources.launches:
        result, launch_world, launch_events = analyze_launch(launch)
        if result.name in events:             # two run dirs with the same scenario
            result = dataclasses.replace(result, name=f"{result.name}-{len(results) + 1}")
        results.append(result)
        events[result.name] = launch_events
        world = max(world, launch_world)
    run_dir = _common_dir([*sources.dumps, *sources.launches])
    saved_run: dict[str, Any] = {}
    if sources.launches and not sources.dumps:
        run_dir = _common_dir([p.parent for p in sources.launches])
        saved = read_json(run_dir / "report.json")
        saved_run = saved.get("run") if isinstance(saved, dict) and isinstance(saved.get("run"), dict) else {}
    if saved_run.get("backend"):
        backends.add(saved_run["backend"])
    info = RunInfo(
        backend="+".join(sorted(backends)) or "unknown", world_size=world, nnodes=_int(saved_run.get("nnodes")) or 1,
        nproc_per_node=_int(saved_run.get("nproc_per_node")) or world,   # dumps do not say: one node assumed
        torch_version=str(saved_run.get("torch_version", "unknown")), distcheck_version=__version__,
        command=command, run_dir=str(run_dir), seed=_int(saved_run.get("seed")),
        duration_s=time.time() - started,
        started_at=datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        hostname=socket.gethostname(), python_version=platform.python_version(), versions=versions,
    )
    return PostMortem(report=Report(run=info, scenarios=tuple(results)), events=events)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _common_dir(paths: Sequence[Path]) -> Path:
    dirs = [str(p.resolve() if p.is_dir() else p.resolve().parent) for p in paths]
    return Path(os.path.commonpath(dirs)) if dirs else Path.cwd()


# -- Flight Recorder dumps ----------------------------------------------------------


def analyze_dumps(files: Sequence[Path], world_size: int | None = None) -> tuple[ScenarioResult, dict[str, Any]]:
    t0 = time.time()
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
    named = {r for d in dumps.values() for ranks in d.pg_ranks.values() for r in ranks}
    if world_size is not None:
        if world_size < 1 or max(dumps) >= world_size:
            raise UsageError(f"--world-size {world_size} does not fit the dumps (they come from ranks up to {max(dumps)})")
        world = tuple(range(world_size))
    else:
        world = tuple(range(max([*dumps, *named]) + 1))
    present = tuple(sorted(dumps))
    missing = tuple(r for r in world if r not in dumps)
    cut_short = tuple(r for r in present if dumps[r].truncated)
    ordered = [dumps[r] for r in present]
    # Ranks with no dump, or a cut-short one, are no group's members for matching:
    # what they did after their last readable entry is unknown, not "never came".
    members = membership(ordered, tuple(r for r in present if r not in cut_short))
    traces = {d.rank: to_events(d, members) for d in ordered}
    traces, renumbered = _close_gaps(traces, {d.rank for d in ordered if d.wrapped})
    outcomes = {r: _fr_outcome(r, events) for r, events in traces.items()}
    # A cut-short rank's calls stop where its file stops: matched, they would make
    # it look like a rank that never came. Its outcome still shows what was read.
    matched = {r: events for r, events in traces.items() if r not in cut_short}
    stuck = any(o.state == "stuck" for o in outcomes.values())
    facts = RunFacts(world_size=len(world), end_reason="stall" if stuck else "completed")
    findings = attribute_by_majority(analyze(matched, outcomes, facts), missing, cut_short)
    observed = observed_kinds(findings)

    backends = set().union(*(d.backends for d in ordered))
    forms = sorted({d.form for d in ordered})
    notes[:0] = _dump_notes(ordered, missing, len(world), world_size is not None, members.inferred, renumbered)
    events = [e for evs in traces.values() for e in evs]
    versions = {"flight_recorder": ",".join(sorted({d.version for d in ordered if d.version})) or "unknown"}
    libs = sorted({d.comm_lib_version for d in ordered if d.comm_lib_version})
    if libs:
        versions["comm_lib"] = ",".join(libs)
    result = ScenarioResult(
        name=FR_SCENARIO, source=str(_common_dir(list(files))), expected=("pass",), observed=observed,
        ok=behaved_as_expected(("pass",), observed), duration_s=time.time() - t0, findings=tuple(findings),
        ranks=tuple(outcomes[r] for r in present), end_reason=facts.end_reason,
        description=f"Flight Recorder dumps ({'/'.join(sorted(backends)) or 'unknown backend'}, "
                    f"{' and '.join(forms)} form) of {len(present)} of {len(world)} ranks.\n" + "\n".join(notes),
        collectives_compared=collectives_compared(matched),
        started_at=min((e.t_enter for e in events if e.t_enter), default=None),
        ended_at=max((e.t_exit or e.t_enter for e in events), default=None),
    )
    return result, {"backends": backends, "versions": versions, "world_size": len(world), "events": traces}


def _fr_outcome(rank: int, events: list[Event]) -> RankOutcome:
    """A rank whose earliest unfinished entry exists is waiting there; otherwise it
    was past its last recorded collective when it dumped (where exactly: unknown)."""
    waiting = next((e for e in events if not e.completed), None)
    if waiting is not None:
        return RankOutcome(rank=rank, state="stuck", collectives=len(events), last_event=waiting,
                           where=waiting.callsite, phase="running")
    return RankOutcome(rank=rank, state="running", collectives=len(events),
                       last_event=events[-1] if events else None, phase="running")


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
                e = dataclasses.replace(e, seq=mapping[e.group][e.seq])
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
        notes.append(f"World size taken as {world} from the file names (dumps do not record it; a missing highest rank goes unnoticed — "
                     f"pass --world-size).")
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
                     "with or without error.")
    notes.append(f"A dump is a snapshot: a collective in flight when it was taken looks like a wait. Dumps do not "
                 f"record the {', '.join(CANNOT_TELL)}, so those are not compared.")
    return notes


# -- blame by majority -----------------------------------------------------------------


def attribute_by_majority(findings: list[Finding], missing: Sequence[int] = (),
                          cut_short: Sequence[int] = ()) -> list[Finding]:
    """Name the odd side of each hang by majority, and say which ranks cannot be judged.

    The analysis lists who waits and who never came; this adds which side is the
    odd one out (the smaller), never "whichever file was read first". A tie is
    stated as a tie. ``missing`` ranks left no dump, ``cut_short`` ones a partial
    one: they are neither side.
    """
    out = []
    for f in findings:
        if f.kind != "hang" or not f.waiting_ranks or not f.absent_ranks or f.odd_ranks:
            out.append(_with_unknown(f, missing, cut_short))
            continue
        waiting, absent = f.waiting_ranks, f.absent_ranks
        total = len(waiting) + len(absent)
        what = f"{f.op} #{f.seq}" + (f" (group {f.group})" if f.group else "")
        if len(waiting) == len(absent):
            sentence = (f"No majority: {len(waiting)} of {total} ranks entered {what} and {len(absent)} never did, "
                        f"so neither side can be called the odd one out.")
            f = dataclasses.replace(f, tie=True, summary=f"{f.summary} {sentence}")
        else:
            odd = waiting if len(waiting) < len(absent) else absent
            rest = total - len(odd)
            verb = "is" if len(odd) == 1 else "are"
            if odd is waiting:
                sentence = (f"By majority, {rank_list(odd)} {verb} the odd one out: {rest} of {total} ranks "
                            f"never called {what}.")
            else:
                sentence = (f"By majority, {rank_list(odd)} {verb} the odd one out: {rest} of {total} ranks "
                            f"are waiting in {what}, which {rank_list(odd)} never entered.")
            f = dataclasses.replace(f, odd_ranks=tuple(odd), summary=f"{f.summary} {sentence}")
        out.append(_with_unknown(f, missing, cut_short))
    return out


def _with_unknown(f: Finding, missing: Sequence[int], cut_short: Sequence[int]) -> Finding:
    if f.kind != "hang" or f.op is None or not (missing or cut_short):
        return f
    extra = tuple(RankDetail(rank=r, role="no dump", note="left no dump") for r in missing)
    extra += tuple(RankDetail(rank=r, role="cut short", note="dump cut short") for r in cut_short)
    parts = []
    if missing:
        parts.append(f"{rank_list(missing)} left no dump")
    if cut_short:
        parts.append(f"{rank_list(cut_short)} left a dump that is cut short")
    unknown = [*missing, *cut_short]
    sentence = (f"{' and '.join(parts)}, so whether {'it' if len(unknown) == 1 else 'they'} entered it "
                f"cannot be told.")
    return dataclasses.replace(f, ranks=f.ranks + extra, summary=f"{f.summary} {sentence[0].upper()}{sentence[1:]}")


# -- distcheck traces ----------------------------------------------------------------


def analyze_launch(launch_dir: Path) -> tuple[ScenarioResult, int, dict[int, list[Event]]]:
    """Re-analyse one distcheck launch from its raw traces."""
    t0 = time.time()
    files = LaunchFiles(launch_dir)
    traces = read_trace_dir(files.traces)
    saved = _saved_scenario(launch_dir)
    status = {r: files.read_status(r) or {} for r in range(_world_of(launch_dir, traces, saved))}
    world = len(status)
    if saved and saved.get("ranks"):
        try:
            outcomes = {o.rank: o for o in (RankOutcome.from_dict(d) for d in saved["ranks"])}
        except (TypeError, ValueError, KeyError):
            raise CorruptInputError(f"{launch_dir.parent / 'report.json'}: rank records are unreadable",
                                    "delete report.json to analyse from the traces alone") from None
    else:
        outcomes = {r: _trace_outcome(r, traces.get(r), status[r], files) for r in status}
    events = {r: t.events for r, t in traces.items()}
    stuck = any(o.state == "stuck" for o in outcomes.values())
    facts = RunFacts(
        world_size=world, end_reason=(saved or {}).get("end_reason") or ("stall" if stuck else "completed"),
        stall_onset=(saved or {}).get("stall_onset"), detected_at=(saved or {}).get("detected_at"))
    results = {r: s["results"] for r, s in status.items() if s.get("results")}
    findings = attribute_by_majority(analyze(events, outcomes, facts, results))
    observed = observed_kinds(findings)
    saved_expected = (saved or {}).get("expected")
    expected = tuple(saved_expected) if isinstance(saved_expected, list) and saved_expected else ("pass",)
    notes = []
    torn = sorted(r for r, t in traces.items() if t.truncated or t.corrupt_lines)
    if torn:
        notes.append(f"{rank_list(torn).capitalize()}: trace file ends in a torn or corrupt record; "
                     f"the complete records are used.")
    no_trace = sorted(set(status) - set(traces))
    if no_trace:
        notes.append(f"{rank_list(no_trace).capitalize()} left no trace file.")
    all_events = [e for evs in events.values() for e in evs]
    result = ScenarioResult(
        name=launch_dir.name, source=str((saved or {}).get("source") or launch_dir), expected=expected,
        observed=observed, ok=behaved_as_expected(expected, observed), duration_s=time.time() - t0,
        findings=tuple(findings), ranks=tuple(outcomes[r] for r in sorted(outcomes)), end_reason=facts.end_reason,
        launch_dir=str(launch_dir),
        description="\n".join([f"distcheck traces of {len(traces)} of {world} ranks.", *notes]),
        collectives_compared=collectives_compared(events),
        started_at=(saved or {}).get("started_at") or min((e.t_enter for e in all_events), default=None),
        ended_at=(saved or {}).get("ended_at"), stall_onset=facts.stall_onset, detected_at=facts.detected_at,
    )
    return result, world, events


def _saved_scenario(launch_dir: Path) -> dict[str, Any] | None:
    """The scenario's record in the run's report.json, if the run got that far."""
    report = read_json(launch_dir.parent / "report.json")
    if not isinstance(report, dict) or not isinstance(report.get("scenarios"), list):
        return None
    for s in report["scenarios"]:
        if isinstance(s, dict) and s.get("launch_dir") and Path(s["launch_dir"]).name == launch_dir.name:
            return s
    return None


def _world_of(launch_dir: Path, traces: Mapping[int, Any], saved: dict[str, Any] | None) -> int:
    ranks = set(traces)
    for sub in ("status", "stacks", "logs"):
        for p in (launch_dir / sub).glob("rank*.*"):
            r = p.stem.removeprefix("rank")
            if r.isdigit():
                ranks.add(int(r))
    for d in (saved or {}).get("ranks") or ():
        if isinstance(d, dict) and isinstance(d.get("rank"), int):
            ranks.add(d["rank"])
    if not ranks:
        raise UsageError(f"{launch_dir}: no rank files in this launch directory")
    return max(ranks) + 1


def _trace_outcome(rank: int, trace: Any, status: dict[str, Any], files: LaunchFiles) -> RankOutcome:
    events = trace.events if trace is not None else []
    open_events = [e for e in events if e.t_exit is None and not e.async_op]
    phase = status.get("phase")
    top = None
    stack_path = files.stacks(rank)
    stack_text = None
    if stack_path.exists():
        dumps = parse_dumps(stack_path.read_text(encoding="utf-8", errors="replace"))
        if dumps:
            stack_text = dumps[0].text[:6000]
            thread = main_stack(dumps[0], status.get("main_thread"))
            frame = user_top(thread.frames) if thread else None
            top = f"{frame.file}:{frame.line}:{frame.function}" if frame else None
    if phase == "error":
        state, where = "crashed", status.get("where") or top
    elif open_events:
        state, where = "stuck", open_events[-1].callsite
    elif phase == "finished":
        state, where = "finished", None
    else:
        state, where = "running", top
    return RankOutcome(
        rank=rank, state=state, host=status.get("host", ""), pid=status.get("pid"), collectives=len(events),
        last_event=events[-1] if events else None, where=where, stack=stack_text,
        exception=status.get("exception"), traceback=status.get("traceback"),
        phase=phase or ("running" if events else None),
    )
