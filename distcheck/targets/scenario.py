"""A scenario (``@scenario`` function, built-in or the user's) as a target: one launch of its own,
or a place in a launch it shares (``targets.shared``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from distcheck.files import run_dir as rundir
from distcheck.launch.launcher import launch
from distcheck.models import PASS, Kind
from distcheck.options import RunOptions
from distcheck.scenario import ScenarioSpec, skip_reason
from distcheck.targets import FromSpec, Ran, RunContext
from distcheck.targets.launching import judged_across_nodes, launch_spec, skipped_result, worker_common_args

# Expectations whose scenarios end with a healthy process group.
BATCHABLE = frozenset({PASS, Kind.NUMERIC, Kind.DUPLICATES, Kind.ORDER, Kind.STRAGGLER, Kind.HEALTH})
# Expectations that may or may not poison the group (SUM vs MAX completes; a shape
# mismatch aborts a gloo rank): they share the launch too, after the healthy ones,
# since a poisoned launch only ends the batch there and the rest runs again.
RISKY = frozenset({Kind.MISMATCH, Kind.COUNT})


def scenario_args(specs: list[ScenarioSpec], options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
    """The worker's argv for one scenario or several in one launch."""
    opts = tuple(a for key, value in options.scenario_options for a in ("--option", f"{key}={value}"))
    pairs = tuple(a for s in specs for a in ("--scenario-file", s.file, "--scenario-name", s.name))
    return (*worker_common_args(options, launch_dir), *opts, *pairs)


@dataclass(frozen=True)
class ScenarioTarget(FromSpec):
    spec: ScenarioSpec
    script = False
    forked = True

    @property
    def source(self) -> str:
        return self.spec.file

    @property
    def shares_launch(self) -> bool:
        return set(self.expect) <= BATCHABLE | RISKY

    @property
    def risky(self) -> bool:
        """It may poison a launch it shares: it runs after the healthy ones."""
        return not set(self.expect) <= BATCHABLE

    def headline(self, ranks: str) -> str:
        return f"1 scenario(s) on {ranks}"

    def renamed(self, name: str) -> ScenarioTarget:
        return ScenarioTarget(dataclasses.replace(self.spec, name=name))

    def at_world_size(self, world_size: int) -> ScenarioTarget:
        return ScenarioTarget(self.spec.at_world_size(world_size))

    def named_files(self) -> list[str]:
        return []

    def check_collected(self, run: object, end_reason: str) -> None:
        return None   # a scenario always has something to judge: its function ran

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]:
        return options, None

    def skip_reason(self, options: RunOptions) -> str | None:
        return skip_reason(self.spec, options.backend, options.nproc_per_node)

    def run(self, ctx: RunContext) -> Ran:
        reason = self.skip_reason(ctx.options)
        if reason:
            return Ran([skipped_result(self, reason)])
        ctx.announce(self)
        launch_dir = ctx.run_dir / self.name
        rundir.prepare_launch_dir(launch_dir)   # a re-used --run-dir: nothing stale mixes into this launch
        channel = ctx.cluster.launch(launch_dir.name, ctx.options.world_size) if ctx.cluster is not None else None
        spec = launch_spec(ctx.options, launch_dir, scenario_args([self.spec], ctx.options, launch_dir), ctx.run_id,
                           channel, forked=True)
        outcome = launch(spec, on_poll=ctx.on_poll)
        return Ran([judged_across_nodes(self, ctx.options, launch_dir, outcome, channel)])
