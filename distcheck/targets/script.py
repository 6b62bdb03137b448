"""The user's own torchrun-style script (or ``-m module``) as a target: it calls
``init_process_group`` itself; distcheck starts its ranks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from distcheck.evidence.collect import CollectedRun
from distcheck.errors import UsageError
from distcheck.files import run_dir as rundir
from distcheck.files import user_code
from distcheck.launch.launcher import launch
from distcheck.models import EndReason, RankState
from distcheck.options import RunOptions
from distcheck.targets import Ran, RunContext
from distcheck.targets.launching import judged_across_nodes, launch_spec, worker_common_args


@dataclass(frozen=True)
class ScriptTarget:
    name: str
    file: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ("pass",)
    description: str = ""
    script = True
    shares_launch = False
    forked = False   # the user's script imports what it imports, in a process of its own

    @property
    def source(self) -> str:
        return self.file or f"-m {self.module}"

    def headline(self, ranks: str) -> str:
        return f"{self.source} on {ranks}"

    def renamed(self, name: str) -> ScriptTarget:
        return replace(self, name=name)

    def at_world_size(self, world_size: int) -> ScriptTarget:
        return self

    def named_files(self) -> list[str]:
        return ([self.file] if self.file else []) + user_code.named_paths(self.args)

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]:
        return options, None

    def worker_args(self, options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
        what = ("--module", self.module) if self.module else ("--script", self.file)
        return (*worker_common_args(options, launch_dir), *what, "--", *self.args)

    def check_collected(self, run: CollectedRun, end_reason: str) -> None:
        """A .py file that never touched torch.distributed is neither a scenario nor a job."""
        if end_reason != EndReason.COMPLETED:
            return
        if run.traces and any(t.events for t in run.traces.values()):
            return
        statuses = list(run.outcomes.values())
        if statuses and all(o.state == RankState.FINISHED for o in statuses) and not run.initialized_process_group:
            raise UsageError(
                f"{self.source} ran to the end on every rank without calling init_process_group, "
                "and it has no @scenario function: there was nothing to check",
                "point distcheck at a distributed script, or decorate scenario functions with @distcheck.scenario",
            )

    def run(self, ctx: RunContext) -> Ran:
        ctx.announce(self)
        launch_dir = ctx.run_dir / self.name
        rundir.prepare_launch_dir(launch_dir)   # a re-used --run-dir: nothing stale mixes into this launch
        channel = ctx.cluster.launch(launch_dir.name, ctx.options.world_size) if ctx.cluster is not None else None
        outcome = launch(launch_spec(ctx.options, launch_dir, self.worker_args(ctx.options, launch_dir), ctx.run_id,
                                     channel), on_poll=ctx.on_poll, on_output=ctx.on_output)
        return Ran([judged_across_nodes(self, ctx.options, launch_dir, outcome, channel)])
