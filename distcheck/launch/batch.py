"""Several scenarios in one launch: following which one runs, and splitting the launch back into
per-scenario runs (which scenarios share a launch: ``targets.shared``).

Starting ranks costs seconds (torch import, rendezvous), so scenarios that
leave their process group healthy — those expected to pass, or to show only
findings that complete normally (wrong numbers, crossed calls, stragglers) —
share one launch. Scenarios expected to mismatch may or may not poison their
process group: they share it too, after the healthy ones. A scenario expected
to hang or crash always poisons it and gets a launch of its own; the scenarios
a shared launch never reached, because one of them failed, run again.

After the launch each scenario gets an ordinary launch directory of its own
(its part of every rank's trace, its status, the logs), so every later step —
analysis, ``distcheck report``, timelines — sees no difference.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from distcheck.launch.launcher import LaunchOutcome
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.models import EndReason, Phase
from distcheck.scenario import ScenarioSpec
from distcheck.files.trace_reader import split_segments
from distcheck.launch.watchdog import WatchdogResult

# Per-batch fields of a rank's status that do not belong to one scenario.
_BATCH_FIELDS: dict[str, Any] = dict.fromkeys(("scenarios", "current", "results", "collectives"))
# A failure's fields: they belong to the scenario running when it happened, never to one
# that had finished on that rank before (a later scenario's gloo abort is not theirs).
_FAILURE_FIELDS: dict[str, Any] = dict.fromkeys(("exit_code", "exception", "traceback", "where"))


class ScenarioFollower:
    """Announces each scenario of a shared launch when it starts, not only the launch's first:
    rank 0's status names the scenario it runs (the ranks move on together, through the store)."""

    def __init__(self, files: LaunchFiles, specs: list[ScenarioSpec], announce: Callable[[ScenarioSpec], None]) -> None:
        self.files, self.specs, self.announce = files, specs, announce
        self.announced = 0

    def start(self) -> None:
        """The launch begins: its first scenario starts as soon as the ranks are up."""
        self._through(0)

    def poll(self) -> None:
        status = self.files.read_status(0)
        names = [s.name for s in self.specs]
        if status is not None and status.current in names:
            self._through(names.index(status.current))

    def finish(self, reached: set[str]) -> None:
        """After the launch: those that ran between the last poll and its end, in their order."""
        indices = [i for i, s in enumerate(self.specs) if s.name in reached]
        if indices:
            self._through(max(indices))

    def _through(self, index: int) -> None:
        while self.announced <= index:
            self.announce(self.specs[self.announced])
            self.announced += 1


@dataclass
class SplitLaunch:
    """What became of each scenario of a batched launch."""

    completed: list[tuple[ScenarioSpec, Path, LaunchOutcome]] = field(default_factory=list)
    failed: tuple[ScenarioSpec, Path, LaunchOutcome] | None = None   # the one running when the launch ended
    not_started: list[ScenarioSpec] = field(default_factory=list)


def split(batch: LaunchFiles, specs: list[ScenarioSpec], world_size: int, outcome: LaunchOutcome,
          run_dir: Path) -> SplitLaunch:
    statuses = {r: batch.read_status(r) or RankStatus(rank=r) for r in range(world_size)}
    segments = {r: _segments(batch.trace(r)) for r in range(world_size)}
    out = SplitLaunch()
    for spec in specs:
        done = [(statuses[r].scenarios or {}).get(spec.name) for r in range(world_size)]
        started = any(spec.name in segments[r] or statuses[r].current == spec.name
                      for r in range(world_size))
        if all(done):
            launch_dir = _materialize(batch, spec, run_dir, statuses, segments, world_size, failed=False)
            finished = cast("list[dict]", done)   # all(done): every rank's result is there
            out.completed.append((spec, launch_dir, _completed_outcome(finished, outcome.watchdog.busy_lines)))
        elif started and out.failed is None:
            launch_dir = _materialize(batch, spec, run_dir, statuses, segments, world_size, failed=True)
            out.failed = (spec, launch_dir, _failed_outcome(outcome, out.completed))
        else:
            out.not_started.append(spec)
    return out


def _segments(path: Path) -> dict[str, bytes]:
    try:
        return split_segments(path.read_bytes())
    except OSError:
        return {}


def _completed_outcome(done: list[dict], busy_lines: list[tuple[int, float, str]]) -> LaunchOutcome:
    start = min(d["t_start"] for d in done)
    end = max(d["t_end"] for d in done)
    own = [s for s in busy_lines if start <= s[1] <= end]   # taken while this scenario ran
    return LaunchOutcome(end_reason=EndReason.COMPLETED, started_at=start, ended_at=end,
                         watchdog=WatchdogResult(busy_lines=own))


def _failed_outcome(outcome: LaunchOutcome, completed: list[tuple[ScenarioSpec, Path, LaunchOutcome]]
                    ) -> LaunchOutcome:
    """The launch's end, as the scenario running when it came: that scenario began when the ranks were done
    with the one before it, not when the launch began (its duration was the whole launch's)."""
    if not completed:
        return outcome
    return dataclasses.replace(outcome, started_at=max(done.ended_at for _, _, done in completed))


def _materialize(batch: LaunchFiles, spec: ScenarioSpec, run_dir: Path, statuses: dict[int, RankStatus],
                 segments: dict[int, dict[str, bytes]], world_size: int, failed: bool) -> Path:
    """An ordinary launch directory holding only this scenario's part of the batch."""
    files = LaunchFiles(run_dir / spec.name)
    if files.root.exists():
        shutil.rmtree(files.root)
    files.make()
    for rank in range(world_size):
        files.trace(rank).write_bytes(segments[rank].get(spec.name, b""))
        files.write_status(rank, _status_for(statuses[rank], spec.name))
        _copy(batch.log(rank), files.log(rank))
        if failed:   # stacks and Flight Recorder dumps were taken while this scenario ran
            _copy(batch.stacks(rank), files.stacks(rank))
            _copy(batch.terminated_stack(rank), files.terminated_stack(rank))
            _copy(batch.flight_recorder(rank), files.flight_recorder(rank))
    return files.root


def _status_for(status: RankStatus, name: str) -> RankStatus:
    own = dataclasses.replace(status, **_BATCH_FIELDS)
    done = (status.scenarios or {}).get(name)
    if done is not None:
        own = dataclasses.replace(own, **_FAILURE_FIELDS, phase=Phase.FINISHED, results=done["results"],
                                  collectives=done["collectives"])
    return own


def _copy(src: Path, dst: Path) -> None:
    if src.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
