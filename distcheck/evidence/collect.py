"""Collecting what each rank left behind into ``RankOutcome`` values.

This is the I/O half of the post-run step (status files, traces, stack dumps,
the agent's per-rank failures); ``analyze`` is the pure half, ``verdict`` joins them.

When one rank dies, its peers usually fail too ("Connection closed by peer",
SIGTERM from the agent). Those are consequences, not causes: only the first
*primary* failure is reported as ``crashed``; the others keep the state they
were in (``stuck`` in the collective they were waiting in, or ``killed``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distcheck.diagnose.backend_error import abort_text
from distcheck.diagnose.common import is_peer_failure
from distcheck.diagnose.rank_state import classify_rank
from distcheck.models import EndReason, Event, Phase, RankOutcome
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.metric_records import with_spilled_computes
from distcheck.files.samples import read_samples
from distcheck.files.stacks import (IDLE_IN_POOL, StackDump, fatal_dump, idle_in_pool, main_stack, read_dumps,
                                    torch_dir, user_top)
from distcheck.files.trace_reader import RankTrace, read_trace_dir

if TYPE_CHECKING:   # the launcher is only a type here: ``analyze`` need not import it
    from distcheck.launch.launcher import LaunchOutcome

MAX_STACK_CHARS = 6000

# Ends that cut ranks off mid-work: a rank the agent does not list as failed left by itself.
_CUT_SHORT = (EndReason.CRASH, EndReason.CERTAIN_HANG, EndReason.STALL, EndReason.BUSY_TIMEOUT, EndReason.TIMEOUT,
              EndReason.MAX_DURATION)

@dataclass
class CollectedRun:
    """Everything analysis needs about one launch."""

    world_size: int
    traces: dict[int, RankTrace]
    outcomes: dict[int, RankOutcome]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)   # scenario results per rank
    initialized_process_group: bool = False


@dataclass
class _RankFacts:
    rank: int
    status: RankStatus
    trace: RankTrace
    exit_code: int | None
    signal: str | None
    dump: StackDump | None
    flight_recorder: dict[str, dict[str, int]] | None = None
    primary: bool = False
    left_early: bool = False     # exited with code 0 in the middle of its work (os._exit(0)) while others ran
    abort: str | None = None     # the C++ exception a SIGABRT came from (gloo's own words), from its log

    @property
    def failed(self) -> bool:
        return (self.status.phase == Phase.ERROR or self.signal is not None or self.exit_code not in (None, 0)
                or self.left_early)


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


def _mark_primary(facts: list[_RankFacts], killed_by_us: set[int], node_lost: bool) -> None:
    """The root-cause candidates: failures that are not reactions to another failure."""
    failed = [f for f in facts if f.failed and f.rank not in killed_by_us
              and f.status.phase not in (Phase.INTERRUPTED, Phase.FINISHED)]
    reactions = [f for f in failed if f.status.phase == Phase.ERROR and is_peer_failure(f.status.exception)]
    primary = [f for f in failed if f not in reactions and f.signal != "SIGTERM"]
    # A rank that vanished without a word (SIGTERM and SIGKILL leave none) beside one that said why it
    # failed was ended after it: the one with a word is the cause.
    worded = [f for f in primary if f.signal is not None or f.status.phase == Phase.ERROR
              or f.exit_code not in (None, 0)]
    # With no word from any: one that vanished inside a collective was waiting for one that vanished
    # outside (mp.spawn terminates the survivors after a rank dies): the latter is the cause.
    outside = [f for f in primary if not (f.trace.events and f.trace.events[-1].t_exit is None)]
    primary = worded or outside or primary
    if not primary and not reactions:
        primary = failed   # e.g. every rank was SIGTERMed from outside: report them as they are
    # Only reactions (a peer left, e.g. it finished and destroyed its process group): the traces tell
    # who never came to the collectives the reacting ranks failed in. One that failed outside any
    # collective (in init_process_group while its peers had already left, or waiting on the store for a
    # key no peer sets) is a failure of its own: nothing else explains it, and its exit status is the job's.
    # A lost node explains it (its ranks' ends went with it, and the run says so).
    if not primary and not node_lost:
        primary = [f for f in reactions if _waiting_in(f.trace) is None]
    for f in primary:
        f.primary = True


def _another_failed_first(files: LaunchFiles, launch: LaunchOutcome, rank: int) -> bool:
    """Another rank failed on its own (a signal, or an error that is not a reaction to a peer's end).
    torch's launcher then stops the other ranks itself (seen on torch 2.6 and 2.9, not on 2.13): they are
    that failure's consequence, not ranks that left with code 0 by themselves. A node lost mid-run took
    its ranks' ends with it: the first failure may have been one of them (its peers then fail as reactions)."""
    if launch.records_lost:
        return True
    for r, failure in launch.failures.items():
        if r == rank:
            continue
        if failure.signal is not None:
            return True
        status = files.read_status(r)
        reaction = status is not None and status.phase == Phase.ERROR and is_peer_failure(status.exception)
        if failure.exit_code not in (None, 0) and not reaction:
            return True
    return False


def collect(files: LaunchFiles, world_size: int, launch: LaunchOutcome) -> CollectedRun:
    traces = read_trace_dir(files.traces)
    killed = set(launch.watchdog.killed_ranks)
    facts = []
    for rank in range(world_size):
        status = _before_teardown(files.read_status(rank) or RankStatus(rank=rank), rank in killed,
                                  launch.watchdog.detected_at)
        failure = launch.failures.get(rank)
        exit_code = failure.exit_code if failure else (0 if launch.end_reason == EndReason.COMPLETED else None)
        # The agent lists only failures: a rank it does not list, that distcheck did not kill and that
        # never reached the end of its work, left by itself with code 0 (os._exit(0)) while others ran.
        left_early = (failure is None and rank not in killed and status.phase in (Phase.STARTING, Phase.RUNNING)
                      and launch.end_reason in _CUT_SHORT and not _another_failed_first(files, launch, rank))
        if left_early:
            exit_code = 0
        # A rank of the user's own command that vanished mid-work: it failed, how is not known.
        vanished = failure is not None and failure.exit_code is None and failure.signal is None
        f = _RankFacts(rank, status, traces.get(rank) or RankTrace(rank=rank), exit_code,
                       failure.signal if failure else None, read_stack_dump(files, rank),
                       read_flight_recorder_status(files.flight_recorder(rank)), left_early=left_early or vanished)
        if f.signal == "SIGABRT" and not status.exception:
            f.abort = _abort_in_log(files.log(rank))
        facts.append(f)
    if not EndReason.of(launch.end_reason).interrupted:
        _mark_primary(facts, killed, node_lost=bool(launch.records_lost))
    outcomes = {f.rank: _outcome(f, launch, f.rank in killed) for f in facts}
    results = {f.rank: _results(f.status, files.samples(f.rank), files.metrics_dir) for f in facts}
    results = {r: res for r, res in results.items() if res}
    initialized = any(f.status.pg_initialized for f in facts)
    return CollectedRun(world_size=world_size, traces=traces, outcomes=outcomes, results=results,
                        initialized_process_group=initialized)


def _before_teardown(status: RankStatus, killed_by_us: bool, detected_at: float | None) -> RankStatus:
    """A rank of the user's command that wrote "finished" only after distcheck decided to end the run
    left through its own error handling (a test harness that catches the peer's "Connection closed"
    and exits): that is a reaction to the teardown, not the end of its work."""
    if (killed_by_us and detected_at is not None and status.phase == Phase.FINISHED
            and status.t_update is not None and status.t_update >= detected_at):
        return dataclasses.replace(status, phase=Phase.RUNNING)
    return status


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


def stack_top(dump: StackDump | None, main_thread: Any, torch_prefix: str = "/torch/") -> str | None:
    """``file:line:function`` of the user's innermost frame on the main thread."""
    if dump is None:
        return None
    thread = main_stack(dump, main_thread)
    if thread and idle_in_pool(thread.frames):
        return IDLE_IN_POOL   # a pool worker between tasks, not a place in user code
    frame = user_top(thread.frames, torch_prefix) if thread else None
    return f"{frame.file}:{frame.line}:{frame.function}" if frame else None


def _waiting_in(trace: RankTrace) -> Event | None:
    """The collective a rank was in at the end: still open, or the one that failed under it (an older call
    that failed and was survived is not where the rank is now)."""
    events = trace.events
    waiting_in = next((e for e in reversed(events) if not e.async_op and (e.t_exit is None or e.error)), None)
    if waiting_in is not None and waiting_in.t_exit is not None and waiting_in is not events[-1]:
        return None
    return waiting_in


def _outcome(f: _RankFacts, launch: LaunchOutcome, killed_by_us: bool) -> RankOutcome:
    events = f.trace.events
    waiting_in = _waiting_in(f.trace)
    state, where = classify_rank(f.status.phase, waiting_in,
                                 stack_top(f.dump, f.status.main_thread, torch_dir()),
                                 f.status.where, primary=f.primary, end_reason=launch.end_reason,
                                 killed_by_us=killed_by_us)
    seen = launch.watchdog.last_progress.get(f.rank)
    return RankOutcome(
        rank=f.rank, state=state, host=f.status.host, node=f.status.node, pid=f.status.pid,
        exit_code=f.exit_code, signal=f.signal, collectives=f.trace.calls, last_event=events[-1] if events else None,
        where=where, stack=f.dump.text[:MAX_STACK_CHARS] if f.dump else None,
        exception=f.status.exception or f.abort, traceback=f.status.traceback, phase=f.status.phase,
        flight_recorder=f.flight_recorder,
        rss_bytes=seen.rss_bytes if seen else None, peak_rss_bytes=seen.peak_rss_bytes if seen else None,
        unwatched=f.status.unwatched, hook_failures=f.status.hook_failures,
        busy_at=next((where for r, _, where in reversed(launch.watchdog.busy_lines) if r == f.rank), None),
    )
