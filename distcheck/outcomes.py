"""Collecting what each rank left behind into ``RankOutcome`` values.

This is the I/O half of the post-run step (status files, traces, stack dumps,
the agent's per-rank failures); ``analysis`` is the pure half.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from distcheck.launcher import LaunchOutcome
from distcheck.models import Event, RankOutcome
from distcheck.rankfiles import LaunchFiles
from distcheck.stacks import main_stack, parse_dumps, user_top
from distcheck.tracefile import RankTrace, read_trace_dir

MAX_STACK_CHARS = 6000

@dataclass
class CollectedRun:
    """Everything analysis needs about one launch."""

    world_size: int
    traces: dict[int, RankTrace]
    outcomes: dict[int, RankOutcome]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)   # scenario results per rank

def _torch_dir() -> str:
    torch = sys.modules.get("torch")
    return os.path.dirname(torch.__file__) + os.sep if torch is not None else "/torch/"

def collect(files: LaunchFiles, world_size: int, launch: LaunchOutcome) -> CollectedRun:
    traces = read_trace_dir(files.traces)
    outcomes: dict[int, RankOutcome] = {}
    results: dict[int, dict[str, Any]] = {}
    killed = set(launch.watchdog.killed_ranks)
    first_deaths = set(launch.watchdog.first_deaths)
    for rank in range(world_size):
        status = files.read_status(rank) or {}
        trace = traces.get(rank) or RankTrace(rank=rank)
        failure = launch.failures.get(rank)
        dump = None
        stack_path = files.stacks(rank)
        if stack_path.exists():
            dumps = parse_dumps(stack_path.read_text(encoding="utf-8", errors="replace"))
            dump = dumps[0] if dumps else None
        outcomes[rank] = _outcome(rank, status, trace, failure, dump, launch, rank in killed, rank in first_deaths)
        if status.get("results"):
            results[rank] = status["results"]
    return CollectedRun(world_size=world_size, traces=traces, outcomes=outcomes, results=results)

def _outcome(rank, status, trace, failure, dump, launch, killed_by_us, died_first) -> RankOutcome:
    phase = status.get("phase")
    events = trace.events
    last: Event | None = events[-1] if events else None
    open_events = [e for e in events if e.t_exit is None and not e.async_op]
    exit_code = failure.exit_code if failure else (0 if launch.end_reason == "completed" else None)
    sig = failure.signal if failure else None
    stack_text = dump.text[:MAX_STACK_CHARS] if dump else None
    top = None
    if dump is not None:
        thread = main_stack(dump, status.get("main_thread"))
        frame = user_top(thread.frames, _torch_dir()) if thread else None
        top = f"{frame.file}:{frame.line}:{frame.function}" if frame else None

    if phase == "error":
        state, where = "crashed", status.get("where") or top
    elif phase == "finished":
        state, where = "finished", None
    elif sig and not killed_by_us and (sig != "SIGTERM" or died_first):
        state, where = "crashed", (open_events[-1].callsite if open_events else top)
    elif exit_code not in (None, 0) and not sig and not killed_by_us:
        state, where = "crashed", top
    elif open_events:
        state, where = "stuck", open_events[-1].callsite
    elif launch.end_reason in ("max_duration",) or (killed_by_us and launch.end_reason in ("stall", "timeout")):
        state, where = "running", top
    elif launch.end_reason == "completed":
        state, where = "finished", None
    else:
        state, where = "killed", top
    return RankOutcome(
        rank=rank, state=state, host=status.get("host", ""), pid=status.get("pid") or (failure.pid if failure else None),
        exit_code=exit_code, signal=sig, collectives=len(events), last_event=last, where=where,
        stack=stack_text, exception=status.get("exception"), traceback=status.get("traceback"), phase=phase,
    )
