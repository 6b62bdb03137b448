"""The user's own launch command (``distcheck run -- CMD``) as a target: it starts its own ranks,
found as they initialize (``launch.command``); on one node every generation of ranks is judged on
its own and the verdicts go per pytest test."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from distcheck.diagnose.verdict import Scenario, command_ended, merge_results
from distcheck.files import run_dir as rundir
from distcheck.files import user_code
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch.rank_output import CommandOutput
from distcheck.launch.command import (CommandOutcome, CommandSpec, command_options, command_output_tail,
                                     launch_command, launch_generations)
from distcheck.models import EndReason, ScenarioResult
from distcheck.options import RunOptions
from distcheck.targets import FromSpec, Ran, RunContext
from distcheck.targets.launching import judged_across_nodes, limits_of, result_of_launch


@dataclass(frozen=True)
class CommandTarget(FromSpec):
    spec: CommandSpec
    script = True
    shares_launch = False
    forked = False

    @property
    def source(self) -> str:
        return self.spec.source

    def headline(self, ranks: str) -> str:
        return self.source   # its ranks are counted as they initialize

    def renamed(self, name: str) -> CommandTarget:
        return CommandTarget(dataclasses.replace(self.spec, name=name))

    def at_world_size(self, world_size: int) -> CommandTarget:
        return self

    def named_files(self) -> list[str]:
        return user_code.named_paths(self.spec.argv)

    def check_collected(self, run: object, end_reason: str) -> None:
        return None   # whatever the command did is judged, traced ranks or not

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]:
        """The report's world size is the one the command's ranks reported; its output goes in too."""
        launch_dir = run_dir / self.name
        return command_options(options, launch_dir), command_output_tail(LaunchFiles(launch_dir)) or None

    def run(self, ctx: RunContext) -> Ran:
        ctx.announce(self)
        launch_dir = ctx.run_dir / self.name
        rundir.prepare_launch_dir(launch_dir)
        output = CommandOutput(launch_dir, ctx.on_output) if ctx.on_output is not None else None
        if output is not None:   # the command's output on the terminal as it comes, its ranks' lines "[rankN]:"
            output.start()
        try:
            return self._launch(ctx, launch_dir)
        finally:
            if output is not None:
                output.stop()

    def _launch(self, ctx: RunContext, launch_dir: Path) -> Ran:
        flight_recorder = ctx.options.flight_recorder is not False
        limits = limits_of(ctx.options)
        if ctx.cluster is None:
            outcome = launch_generations(self.spec, launch_dir, limits, flight_recorder, ctx.on_poll,
                                         rank_env=ctx.options.rank_env)
            return Ran(self._results(ctx.options, outcome, launch_dir))
        cluster = ctx.cluster
        channel_for = lambda world: cluster.launch(launch_dir.name, world)   # noqa: E731
        launched, channel = launch_command(self.spec, launch_dir, limits, flight_recorder, ctx.on_poll,
                                           rank_env=ctx.options.rank_env, channel_for=channel_for)
        options = command_options(ctx.options, launch_dir, launched.world_size)
        return Ran([judged_across_nodes(self, options, launch_dir, launched, channel)])

    def _results(self, options: RunOptions, command: CommandOutcome, launch_dir: Path) -> list[ScenarioResult]:
        """One result per pytest test whose ranks ran (each of its generations judged on its own, then
        merged), one for ranks outside any test, and one for the command itself where only it explains
        the run's end (it exited non-zero, or distcheck ended it between generations)."""
        if not command.generations:
            return [self._unchecked(options, command, launch_dir)]
        tests = any(g.test for g in command.generations)
        groups: dict[str | None, list[ScenarioResult]] = {}
        for i, gen in enumerate(command.generations):
            # Without tests, the command's exit belongs to its ranks' verdict (its last generation's), unless
            # distcheck ended the command itself (then its exit code is distcheck's doing).
            last = not tests and i == len(command.generations) - 1 and command.end_reason == EndReason.COMPLETED
            outcome = dataclasses.replace(gen.outcome, command_exit=gen.outcome.command_exit if last else None)
            gen_target = CommandTarget(dataclasses.replace(
                self.spec, name=gen.test or self.name,
                description=f"pytest test {gen.test}" if gen.test else self.description))
            gen_options = command_options(options, gen.launch_dir, outcome.world_size)
            result = result_of_launch(gen_target, gen_options, gen.launch_dir, outcome)
            groups.setdefault(gen.test, []).append(dataclasses.replace(result, test=gen.test))
        results = [merge_results(parts) for parts in groups.values()]
        own = command_ended(Scenario(name=self.name, source=self.source, expected=self.expect,
                                     description=self.description, launch_dir=str(launch_dir)),
                            command.end_reason, command.command_exit, command.why_ended,
                            explained=any(not r.ok for r in results) or not tests,
                            started_at=command.started_at, ended_at=command.ended_at)
        if own is not None:
            own = dataclasses.replace(own, script=True, log_tail=command.output_tail)
        return results + ([own] if own is not None else [])

    def _unchecked(self, options: RunOptions, command: CommandOutcome, launch_dir: Path) -> ScenarioResult:
        """A command that ran to its end and never started a process group: nothing was checked, which is said
        in one line; the run ends with the command's own exit code (``Report.unchecked_exit``), unless the
        user asked for a process group (``--require-process-group``: then it is exit 6, nothing ran)."""
        code = command.command_exit
        why = f"it started no process group, so nothing was checked (it exited with code {code}"
        why += f": {command.why_ended})" if command.why_ended else ")"
        if options.require_process_group:
            why += "; --require-process-group makes that an error"
        return ScenarioResult(
            name=self.name, source=self.source, expected=self.expect, observed=(), ok=False, duration_s=max(
                command.ended_at - command.started_at, 0.0), skipped=why, end_reason=EndReason.NOTHING_RAN,
            launch_dir=str(launch_dir), description=self.description, log_tail=command.output_tail or None,
            started_at=command.started_at, ended_at=command.ended_at, script=True,
            command_exit=None if options.require_process_group else code)
