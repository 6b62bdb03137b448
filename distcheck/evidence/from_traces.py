"""Post-mortem of a distcheck launch directory (``traces/rank*.trace`` plus
status and stack files, and the run's report.json when it got that far): one
``ScenarioResult`` through the same ``verdict`` as a live run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distcheck.diagnose.rules import RunFacts
from distcheck.evidence.collect import MAX_STACK_CHARS, read_stack_dump
from distcheck.diagnose.where import stack_top
from distcheck.diagnose.rank_state import classify_rank
from distcheck.diagnose.verdict import Blame, Evidence, Scenario, scenario_result
from distcheck.errors import CorruptInputError, UsageError
from distcheck.files.launch_dir import LaunchFiles, RankStatus, read_json
from distcheck.files.metric_records import saved_reference, with_spilled_computes
from distcheck.files.saved_runs import REPORT_FILE
from distcheck.files.trace_reader import RankTrace, read_trace_dir
from distcheck.models import EndReason, Event, Phase, RankOutcome, RankState, ScenarioResult, inline
from distcheck.text import rank_list


def analyze_launch(launch_dir: Path) -> tuple[ScenarioResult, int, dict[int, list[Event]]]:
    """Re-analyse one distcheck launch from its raw traces."""
    t0 = time.time()
    files = LaunchFiles(launch_dir)
    traces = read_trace_dir(files.traces)
    saved = _saved_scenario(launch_dir) or {}
    status = {r: files.read_status(r) or RankStatus(rank=r) for r in range(_world_of(files, traces, saved))}
    world = len(status)
    outcomes = _outcomes(launch_dir, files, traces, status, saved)
    events = {r: t.events for r, t in traces.items()}
    stuck = any(o.state == RankState.STUCK for o in outcomes.values())
    facts = RunFacts(
        world_size=world, end_reason=saved.get("end_reason") or (EndReason.STALL if stuck else EndReason.COMPLETED),
        stall_onset=saved.get("stall_onset"), detected_at=saved.get("detected_at"),
        waited={r: t.waited for r, t in traces.items() if t.waited},
        metric_reference=saved_reference(files.metrics_dir))   # the replay's answer as the run had it
    all_events = [e for evs in events.values() for e in evs]
    evidence = Evidence(
        events=events, outcomes=outcomes, facts=facts,
        results={r: with_spilled_computes(s.results, files.metrics_dir) for r, s in status.items() if s.results},
        started_at=saved.get("started_at") or min((e.t_enter for e in all_events), default=None),
        ended_at=saved.get("ended_at"))
    saved_expected = saved.get("expected")
    scenario = Scenario(
        name=launch_dir.name, source=str(saved.get("source") or launch_dir),
        expected=tuple(saved_expected) if isinstance(saved_expected, list) and saved_expected else ("pass",),
        description="\n".join([f"distcheck traces of {len(traces)} of {world} ranks.", *_notes(traces, status)]),
        launch_dir=str(launch_dir))
    result = scenario_result(scenario, evidence, 0.0, Blame())
    # A script (or command) is reported as a script: it declared no expectation. Without the run's own record
    # no expectation is known either, so none is claimed. The analysis itself is a post-mortem's duration.
    script = bool(saved.get("script")) if saved else True
    return dataclasses.replace(result, duration_s=time.time() - t0, script=script,
                               test=saved.get("test") if isinstance(saved.get("test"), str) else None), world, events


def _outcomes(launch_dir: Path, files: LaunchFiles, traces: Mapping[int, RankTrace],
              status: Mapping[int, RankStatus], saved: dict[str, Any]) -> dict[int, RankOutcome]:
    """The rank records the run saved, or else what the traces, status and stack files say."""
    if not saved.get("ranks"):
        return {r: _trace_outcome(r, traces.get(r), status[r], files) for r in status}
    try:
        return {o.rank: o for o in (RankOutcome.from_dict(d) for d in saved["ranks"])}
    except (TypeError, ValueError, KeyError):
        raise CorruptInputError(f"{launch_dir.parent / REPORT_FILE}: rank records are unreadable",
                                f"delete {REPORT_FILE} to analyse from the traces alone") from None


def _notes(traces: Mapping[int, RankTrace], status: Mapping[int, Any]) -> list[str]:
    notes = []
    torn = sorted(r for r, t in traces.items() if t.truncated or t.corrupt_records)
    if torn:
        notes.append(f"{rank_list(torn).capitalize()}: trace file ends in a torn or corrupt record; "
                     f"the complete records are used.")
    no_trace = sorted(set(status) - set(traces))
    if no_trace:
        notes.append(f"{rank_list(no_trace).capitalize()} left no trace file.")
    return notes


def _saved_scenario(launch_dir: Path) -> dict[str, Any] | None:
    """The scenario's record in the run's report.json, if the run got that far."""
    report = read_json(launch_dir.parent / REPORT_FILE)
    if not isinstance(report, dict) or not isinstance(report.get("scenarios"), list):
        return None
    try:
        report = inline(report)   # a large job's report.json: its rank rows as every other's
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    for s in report["scenarios"]:
        if isinstance(s, dict) and s.get("launch_dir") and Path(s["launch_dir"]).name == launch_dir.name:
            return s
    return None


def _world_of(files: LaunchFiles, traces: Mapping[int, Any], saved: dict[str, Any] | None) -> int:
    ranks = set(traces) | files.ranks_on_disk()
    for d in (saved or {}).get("ranks") or ():
        if isinstance(d, dict) and isinstance(d.get("rank"), int):
            ranks.add(d["rank"])
    if not ranks:
        raise UsageError(f"{files.root}: no rank files in this launch directory")
    return max(ranks) + 1


def _trace_outcome(rank: int, trace: RankTrace | None, status: RankStatus, files: LaunchFiles) -> RankOutcome:
    """Without the launcher's word, every error is a root cause and how the run ended is unknown."""
    events = trace.events if trace is not None else []
    open_events = [e for e in events if e.t_exit is None and not e.async_op]
    phase = status.phase
    dump = read_stack_dump(files, rank)
    # The analysing machine's torch is not the run's: the default prefix stands for it.
    state, where = classify_rank(phase, open_events[-1] if open_events else None,
                                 stack_top(dump, status.main_thread), status.where,
                                 primary=phase == Phase.ERROR)
    return RankOutcome(
        rank=rank, state=state, host=status.host, pid=status.pid,
        collectives=trace.calls if trace is not None else 0,
        last_event=events[-1] if events else None, where=where, stack=dump.text[:MAX_STACK_CHARS] if dump else None,
        exception=status.exception, traceback=status.traceback,
        phase=phase or (Phase.RUNNING if events else None),
    )
