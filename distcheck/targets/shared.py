"""Scenarios that share one launch (starting ranks costs seconds), and which targets do: ``plan``.
A shared launch is a target like the others; what it never reached (one of its scenarios
poisoned the group) comes back as ``Ran.not_reached`` and runs again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from distcheck.files import run_dir as rundir
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch import batch
from distcheck.launch.launcher import launch
from distcheck.models import Expectation
from distcheck.options import RunOptions
from distcheck.targets import Ran, RunContext, Target
from distcheck.targets.launching import launch_spec, result_of_launch, skipped_result
from distcheck.targets.scenario import ScenarioTarget, scenario_args

if TYPE_CHECKING:
    from distcheck.launch.progress import RankProgress


def plan(targets: list[Target], batching: bool) -> list[Target]:
    """Launch units in order: scenarios that can share a launch together (healthy ones first), every
    other target alone."""
    if not batching:
        return list(targets)
    shared = sorted((t for t in targets if t.shares_launch), key=lambda t: getattr(t, "risky", False))
    alone = [t for t in targets if not t.shares_launch]
    # only scenarios share a launch (``ScenarioTarget.shares_launch``)
    units: list[Target] = [SharedLaunch(tuple(cast("list[ScenarioTarget]", shared)))] if len(shared) > 1 else shared
    return units + alone


@dataclass(frozen=True)
class SharedLaunch:
    scenarios: tuple[ScenarioTarget, ...]
    number: int = 1   # shared launches are numbered in the order they run: batch-1, batch-2, ...
    script = False
    shares_launch = False
    forked = True
    expect: tuple[Expectation, ...] = ()
    description: str = "scenarios sharing one launch"

    @property
    def name(self) -> str:
        return "+".join(s.name for s in self.scenarios)

    @property
    def source(self) -> str:
        return ", ".join(s.source for s in self.scenarios)

    def headline(self, ranks: str) -> str:
        return f"{len(self.scenarios)} scenario(s) on {ranks}"

    def renamed(self, name: str) -> SharedLaunch:
        return self

    def at_world_size(self, world_size: int) -> SharedLaunch:
        return self

    def named_files(self) -> list[str]:
        return []

    def check_collected(self, run: object, end_reason: str) -> None:
        return None

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]:
        return options, None

    def run(self, ctx: RunContext) -> Ran:
        options = ctx.options
        skipped = [skipped_result(s, reason) for s in self.scenarios if (reason := s.skip_reason(options))]
        runnable = [s for s in self.scenarios if not s.skip_reason(options)]
        if len(runnable) <= 1:
            return Ran(skipped + [r for s in runnable for r in s.run(ctx).results])
        by_name = {s.name: s for s in runnable}
        batch_dir = ctx.run_dir / f"batch-{self.number}"
        rundir.prepare_launch_dir(batch_dir)
        specs = [s.spec for s in runnable]
        follower = batch.ScenarioFollower(LaunchFiles(batch_dir), specs, lambda spec: ctx.announce(by_name[spec.name]))
        follower.start()

        def poll(progress: Mapping[int, RankProgress], idle_s: float) -> None:
            follower.poll()
            if ctx.on_poll is not None:
                ctx.on_poll(progress, idle_s)

        outcome = launch(launch_spec(options, batch_dir, scenario_args(specs, options, batch_dir), ctx.run_id,
                                     forked=True), on_poll=poll)
        parts = batch.split(LaunchFiles(batch_dir), specs, options.world_size, outcome, ctx.run_dir)
        done = parts.completed + ([parts.failed] if parts.failed else [])
        follower.finish({spec.name for spec, _, _ in done})
        results = [result_of_launch(by_name[spec.name], options, launch_dir, o) for spec, launch_dir, o in done]
        return Ran(skipped + results, self._next(tuple(by_name[s.name] for s in parts.not_started), bool(results)))

    def _next(self, not_reached: tuple[ScenarioTarget, ...], progressed: bool) -> tuple[Target, ...]:
        """What this launch never reached runs next: together again, or each alone when it made no
        progress at all."""
        if progressed and len(not_reached) > 1:
            return (SharedLaunch(not_reached, self.number + 1),)
        return not_reached
