"""Collecting what each rank left behind into ``RankOutcome`` values.

This is the I/O half of the post-run step (status files, traces, stack dumps,
the agent's per-rank failures); it judges nothing. Which failure is the root
cause and which are reactions is ``diagnose.root_cause``, where a rank is
``diagnose.where`` and its state ``diagnose.rank_state``; ``verdict`` joins them.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distcheck.diagnose.backend_error import abort_text
from distcheck.diagnose.rank_state import classify_rank
from distcheck.diagnose.root_cause import (RankEnd, another_failed_first, before_teardown, left_early,
                                          primary_failures, waiting_in)
from distcheck.diagnose.teardown import split_at_decision
from distcheck.diagnose.where import stack_top
from distcheck.models import EndReason, Event, RankOutcome
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.metric_records import with_spilled_computes
from distcheck.files.samples import read_samples
from distcheck.files.stacks import StackDump, fatal_dump, read_dumps, torch_dir
from distcheck.files.trace_reader import RankTrace, read_trace_dir

if TYPE_CHECKING:   # the launcher is only a type here: ``analyze`` need not import it
    from distcheck.launch.launcher import LaunchOutcome

MAX_STACK_CHARS = 6000

@dataclass
class CollectedRun:
    """Everything analysis needs about one launch."""

    world_size: int
    traces: dict[int, RankTrace]
    outcomes: dict[int, RankOutcome]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)   # scenario results per rank
    initialized_process_group: bool = False
    after_decision: dict[int, list[Event]] = field(default_factory=dict)   # calls entered during the teardown


@dataclass
class _RankFacts:
    end: RankEnd                 # how it ended: what ``diagnose.root_cause`` judges
    trace: RankTrace
    dump: StackDump | None
    flight_recorder: dict[str, dict[str, int]] | None = None
    primary: bool = False

    @property
    def rank(self) -> int:
        return self.end.rank

    @property
    def status(self) -> RankStatus:
        return self.end.status


def read_stack_dump(files: LaunchFiles, rank: int) -> StackDump | None:
    """Where the rank was: the first dump its stack probe wrote (taken before teardown), else the fatal-error
    dump it died with (faulthandler, on its stderr: its log), if any."""
    dumps = read_dumps(files.stacks(rank))
    return dumps[0] if dumps else fatal_dump(files.log(rank))


def read_flight_recorder_status(path) -> dict[str, dict[str, int]] | None:
    """pg_status of a Flight Recorder JSON dump: {group: {last_enqueued_collective, ...}}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    status = data.get("pg_status") if isinstance(data, dict) else None
    if not isinstance(status, dict):
        return None
    return {str(g): {str(k): int(v) for k, v in s.items() if str(v).lstrip("-").isdigit()}
            for g, s in status.items() if isinstance(s, dict)}


def collect(files: LaunchFiles, world_size: int, launch: LaunchOutcome) -> CollectedRun:
    traces = read_trace_dir(files.traces, keep=True)   # for the timeline drawn next (``load_events``)
    # what the verdict rests on: the records as they stood when distcheck decided (diagnose.teardown)
    decided = launch.watchdog.detected_at if EndReason.of(launch.end_reason).by_distcheck else None
    after: dict[int, list[Event]] = {}
    for rank, trace in traces.items():
        trace.events, after[rank] = split_at_decision(trace.events, decided)
    killed = set(launch.watchdog.killed_ranks)
    statuses = {rank: files.read_status(rank) for rank in range(world_size)}
    listed = {r: (failure.exit_code, failure.signal) for r, failure in launch.failures.items()}
    first = another_failed_first(listed, statuses, bool(launch.records_lost))   # before a rank not listed left
    facts = [_rank_facts(files, launch, rank, traces.get(rank) or RankTrace(rank=rank), statuses[rank], killed,
                         first) for rank in range(world_size)]
    if not EndReason.of(launch.end_reason).interrupted:
        primary = primary_failures([f.end for f in facts], killed, node_lost=bool(launch.records_lost))
        for f in facts:
            f.primary = f.rank in primary
    outcomes = {f.rank: _outcome(f, launch, f.rank in killed) for f in facts}
    results = {f.rank: _results(f.status, files.samples(f.rank), files.metrics_dir) for f in facts}
    results = {r: res for r, res in results.items() if res}
    initialized = any(f.status.pg_initialized for f in facts)
    return CollectedRun(world_size=world_size, traces=traces, outcomes=outcomes, results=results,
                        initialized_process_group=initialized, after_decision={r: a for r, a in after.items() if a})


def _rank_facts(files: LaunchFiles, launch: LaunchOutcome, rank: int, trace: RankTrace, read: RankStatus | None,
                killed: set[int], another_first: bool) -> _RankFacts:
    """What one rank left, read: its status as it stood when distcheck decided, its exit, dump and log."""
    status = before_teardown(read or RankStatus(rank=rank), rank in killed, launch.watchdog.detected_at)
    failure = launch.failures.get(rank)
    exit_code = failure.exit_code if failure else (0 if launch.end_reason == EndReason.COMPLETED else None)
    early = left_early(failure is not None, rank in killed, status.phase, launch.end_reason, another_first)
    if early:
        exit_code = 0
    # A rank of the user's own command that vanished mid-work: it failed, how is not known.
    vanished = failure is not None and failure.exit_code is None and failure.signal is None
    signal = failure.signal if failure else None
    abort = _abort_in_log(files.log(rank)) if signal == "SIGABRT" and not status.exception else None
    end = RankEnd(rank, status, trace.events, exit_code, signal, left_early=early or vanished, abort=abort)
    return _RankFacts(end, trace, read_stack_dump(files, rank),
                      read_flight_recorder_status(files.flight_recorder(rank)))


def _log_tail(path, limit: int = 65536) -> str | None:
    """The last ``limit`` bytes of a rank's log (None: no log)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return None


def _abort_in_log(path) -> str | None:
    """gloo's message before it aborted the process: the log's last ``what():`` (read from its tail)."""
    tail = _log_tail(path)
    return abort_text(tail) if tail is not None else None


def _results(status: RankStatus, samples_file, metrics_dir: Path) -> dict[str, Any]:
    """The scenario's declared results plus the DataLoader passes the rank recorded (and the compute() records
    its metrics wrote out as they went)."""
    results = dict(with_spilled_computes(status.results or {}, metrics_dir))
    drawn = read_samples(samples_file)
    if drawn:
        results["samples"] = list(results.get("samples", [])) + drawn
    return results


def _outcome(f: _RankFacts, launch: LaunchOutcome, killed_by_us: bool) -> RankOutcome:
    events = f.trace.events
    state, where = classify_rank(f.status.phase, waiting_in(events),
                                 stack_top(f.dump, f.status.main_thread, torch_dir()),
                                 f.status.where, primary=f.primary, end_reason=launch.end_reason,
                                 killed_by_us=killed_by_us)
    seen = launch.watchdog.last_progress.get(f.rank)
    return RankOutcome(
        rank=f.rank, state=state, host=f.status.host, node=f.status.node, pid=f.status.pid,
        exit_code=f.end.exit_code, signal=f.end.signal, collectives=f.trace.calls,
        last_event=events[-1] if events else None,
        where=where, stack=f.dump.text[:MAX_STACK_CHARS] if f.dump else None,
        exception=f.status.exception or f.end.abort, traceback=f.status.traceback, phase=f.status.phase,
        flight_recorder=f.flight_recorder,
        rss_bytes=seen.rss_bytes if seen else None, peak_rss_bytes=seen.peak_rss_bytes if seen else None,
        unwatched=f.status.unwatched, hook_failures=f.status.hook_failures, pg_timeout_s=f.status.pg_timeout_s,
        pg_initialized=bool(f.status.pg_initialized),
        busy_at=next((where for r, _, where in reversed(launch.watchdog.busy_lines) if r == f.rank), None),
    )
