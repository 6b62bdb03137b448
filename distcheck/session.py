"""Running targets end to end: launches (shared by scenarios where they can be, see
``batch``), then collection and analysis of what every rank left behind.

This is the library behind ``distcheck run``: ``run_targets`` is its entry point; the CLI
parses flags into ``options.RunOptions`` and renders what comes back.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distcheck import interrupt
from distcheck.launch import batch, forkserver
from distcheck.files import run_dir as rundir
from distcheck.files import user_code
from distcheck.diagnose.analyze import RunFacts
from distcheck.diagnose.verdict import Evidence, Scenario, command_ended, merge_results, scenario_result
from distcheck.diagnose.verdict import run_info as build_run_info
from distcheck.errors import LaunchError, UsageError
from distcheck.launch.cluster import ClusterStore, check_endpoint_address, node_address
from distcheck.launch.command import (CommandOutcome, CommandSpec, command_options, command_output_tail,
                                     launch_command, launch_generations)
from distcheck.launch.launcher import (LaunchOutcome, LaunchSpec, launch, merge_node_summaries, node_summary,
                                      quiet_native_warnings, workers_torch_environment)
from distcheck.launch.worker_args import worker_args
from distcheck.launch.replay import with_metric_reference
from distcheck.rank import metrics as metric_recording
from distcheck.models import EndReason, RankState, Report, RunInfo, ScenarioResult
from distcheck.discovery import ScriptSpec, Target
from distcheck.diagnose.collect import CollectedRun, collect
from distcheck.files.launch_dir import LaunchFiles, write_json_atomic
from distcheck.files.saved_runs import REPORT_FILE
from distcheck.options import RunOptions
from distcheck.scenario import OPTIONAL_LIBRARIES, ScenarioSpec, skip_reason
from distcheck.text import plural, rank_list
from distcheck.launch.watchdog import Limits, NodeChannel

LOG_TAIL_LINES = 40


@dataclass
class RunHooks:
    """Callbacks the terminal live view plugs into."""

    scenario_started: Callable[[ScenarioSpec, int, int], None] = lambda spec, i, n: None
    scenario_finished: Callable[[ScenarioResult], None] = lambda result: None
    on_poll: Callable | None = None
    note: Callable[[str], None] = lambda text: None      # what distcheck itself is waiting for
    rank_output: Callable[[int, str], None] | None = None   # a script's ranks' lines, as they write them


@dataclass
class RunState:
    results: list[ScenarioResult] = field(default_factory=list)
    interrupted: bool = False


def prepare_process() -> None:
    """Call first, before torch loads: process-wide settings a run depends on."""
    quiet_native_warnings()


def start_fork_server(specs: list[Target], flight_recorder: bool) -> None:
    """Before torch loads here: a run of scenarios only, whose ranks are forked, gets its fork server
    from this process's own torch import (``forkserver.start_early``)."""
    if specs and all(isinstance(s, ScenarioSpec) for s in specs):
        forkserver.start_early(workers_torch_environment(flight_recorder))


def new_run_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_run_dir(run_dir: Path | None, run_id: str) -> Path:
    """Writable (a real write), private (0700) when created; LaunchError before any launch otherwise."""
    return rundir.make_run_dir(run_dir or Path(".distcheck") / "runs" / run_id)


def library_versions() -> dict[str, str]:
    out = {}
    for name in OPTIONAL_LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def check_script_was_distributed(spec: Target, run: CollectedRun, end_reason: str) -> None:
    """A .py file that never touched torch.distributed is neither a scenario nor a job."""
    if not isinstance(spec, ScriptSpec) or end_reason != EndReason.COMPLETED:
        return
    statuses = [o for o in run.outcomes.values()]
    if run.traces and any(t.events for t in run.traces.values()):
        return
    if statuses and all(o.state == RankState.FINISHED for o in statuses) and not run.initialized_process_group:
        raise UsageError(
            f"{spec.source} ran to the end on every rank without calling init_process_group, "
            "and it has no @scenario function: there was nothing to check",
            "point distcheck at a distributed script, or decorate scenario functions with @distcheck.scenario",
        )


def run_unit(spec: Target, options: RunOptions, launch_dir: Path, run_id: str,
             on_poll: Callable | None = None, cluster: ClusterStore | None = None,
             on_output: Callable[[int, str], None] | None = None) -> list[ScenarioResult]:
    """One target's results: a scenario's or script's one, a command's one per test it ran."""
    if isinstance(spec, CommandSpec):
        return run_command(spec, options, launch_dir, on_poll, cluster)
    return [run_scenario(spec, options, launch_dir, run_id, on_poll, cluster,
                         on_output if isinstance(spec, ScriptSpec) else None)]


def run_scenario(spec: Target, options: RunOptions, launch_dir: Path, run_id: str,
                 on_poll: Callable | None = None, cluster: ClusterStore | None = None,
                 on_output: Callable[[int, str], None] | None = None) -> ScenarioResult:
    reason = None if isinstance(spec, ScriptSpec) else skip_reason(spec, options.backend, options.nproc_per_node)
    if reason:
        return skipped_result(spec, reason)
    rundir.prepare_launch_dir(launch_dir)   # a re-used --run-dir: nothing stale mixes into this launch
    channel = cluster.launch(launch_dir.name, options.world_size) if cluster is not None else None
    outcome = launch(launch_spec(options, launch_dir, worker_args(spec, options, launch_dir), run_id, channel,
                                 scenario=isinstance(spec, ScenarioSpec)), on_poll=on_poll, on_output=on_output)
    return judged_across_nodes(spec, options, launch_dir, outcome, channel)


def judged_across_nodes(spec: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome,
                        channel: NodeChannel | None) -> ScenarioResult:
    """Node 0 gathers every node's files and judges the whole job; another node returns node 0's verdict."""
    files = LaunchFiles(launch_dir)
    timeout_s = options.nodes.rdzv_timeout + 60
    if channel is not None:
        channel.upload(files, node_summary(outcome))
        if not channel.is_leader:
            return ScenarioResult.from_dict(channel.result(timeout_s=timeout_s))
        outcome = merge_node_summaries(outcome, channel.gather(files, timeout_s=timeout_s))
        if channel.lost_nodes:
            outcome = dataclasses.replace(outcome, records_lost=tuple(
                r for r in range(options.world_size) if not files.trace(r).exists()))
    result = result_of_launch(spec, options, launch_dir, outcome)
    if channel is not None:
        channel.post_result(result.to_dict())
    return result


def run_command(spec: CommandSpec, options: RunOptions, launch_dir: Path, on_poll: Callable | None,
                cluster: ClusterStore | None = None) -> list[ScenarioResult]:
    """The user's own launch command: its ranks are found as they initialize (``launch.command``).
    On one node, every generation of ranks is judged on its own, and the verdicts go per pytest test;
    on several nodes, one generation, through the same channel as a script's launch."""
    rundir.prepare_launch_dir(launch_dir)
    limits = launch_spec(options, launch_dir, (), "").limits
    if cluster is None:
        outcome = launch_generations(spec, launch_dir, limits, options.flight_recorder is not False, on_poll)
        return command_results(spec, options, outcome, launch_dir)
    channel_for = lambda world: cluster.launch(launch_dir.name, world)   # noqa: E731
    outcome, channel = launch_command(spec, launch_dir, limits, options.flight_recorder is not False, on_poll,
                                      channel_for)
    options = command_options(options, launch_dir, outcome.world_size)
    return [judged_across_nodes(spec, options, launch_dir, outcome, channel)]


def command_results(spec: CommandSpec, options: RunOptions, command: CommandOutcome,
                    launch_dir: Path) -> list[ScenarioResult]:
    """One result per pytest test whose ranks ran (each of its generations judged on its own, then
    merged), one for ranks outside any test, and one for the command itself where only it explains
    the run's end (it exited non-zero, or distcheck ended it between generations)."""
    tests = any(g.test for g in command.generations)
    groups: dict[str | None, list[ScenarioResult]] = {}
    for i, gen in enumerate(command.generations):
        # Without tests, the command's exit belongs to its ranks' verdict (its last generation's), unless
        # distcheck ended the command itself (then its exit code is distcheck's doing).
        last = not tests and i == len(command.generations) - 1 and command.end_reason == EndReason.COMPLETED
        outcome = dataclasses.replace(gen.outcome, command_exit=gen.outcome.command_exit if last else None)
        gen_spec = dataclasses.replace(spec, name=gen.test or spec.name,
                                       description=f"pytest test {gen.test}" if gen.test else spec.description)
        gen_options = command_options(options, gen.launch_dir, outcome.world_size)
        result = dataclasses.replace(result_of_launch(gen_spec, gen_options, gen.launch_dir, outcome), test=gen.test)
        groups.setdefault(gen.test, []).append(result)
    results = [merge_results(parts) for parts in groups.values()]
    own = command_ended(Scenario(name=spec.name, source=spec.file, expected=spec.expect,
                                 description=spec.description, launch_dir=str(launch_dir)),
                        command.end_reason, command.command_exit, command.why_ended,
                        explained=any(not r.ok for r in results) or not tests,
                        started_at=command.started_at, ended_at=command.ended_at)
    if own is not None:
        own = dataclasses.replace(own, script=True, log_tail=command.output_tail)
    return results + ([own] if own is not None else [])


def launch_spec(options: RunOptions, launch_dir: Path, args: tuple[str, ...], run_id: str,
                channel: NodeChannel | None = None, scenario: bool = False) -> LaunchSpec:
    """``scenario``: scenarios' ranks are forked from a server that imported torch where the installed
    torch allows (``launch.forkserver``); a script's get processes of their own."""
    nodes = options.nodes
    limits = Limits(stall_timeout=options.stall_timeout, busy_timeout=options.busy_timeout, timeout=options.timeout,
                    max_duration=options.max_duration)
    return LaunchSpec(launch_dir=launch_dir, nproc_per_node=options.nproc_per_node, backend=options.backend,
                      worker_args=args, limits=limits, run_id=f"{run_id}-{launch_dir.name}", device=options.device,
                      rdzv_endpoint=nodes.rdzv_endpoint, nnodes=nodes.nnodes, node_rank=nodes.node_rank,
                      local_addr=node_address(nodes), rdzv_timeout=nodes.rdzv_timeout, channel=channel,
                      flight_recorder=options.flight_recorder is not False,
                      forked=scenario and forkserver.available())


def result_of_launch(spec: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome) -> ScenarioResult:
    """Collect what the ranks left in ``launch_dir`` and judge it (the pure part is ``diagnose.verdict``)."""
    files = LaunchFiles(launch_dir)
    run = collect(files, options.world_size, outcome)
    check_script_was_distributed(spec, run, outcome.end_reason)
    facts = RunFacts(world_size=options.world_size, end_reason=outcome.end_reason,
                     stall_onset=outcome.watchdog.stall_onset, detected_at=outcome.watchdog.detected_at,
                     timeout_s=options.timeout, stall_timeout_s=options.stall_timeout, oom_kills=outcome.oom_kills,
                     command_exit=outcome.command_exit, evidence=outcome.watchdog.evidence,
                     late_evidence=outcome.watchdog.late_evidence, records_lost=outcome.records_lost,
                     elided={r: t.elided for r, t in run.traces.items() if t.elided})
    evidence = Evidence(events={r: t.events for r, t in run.traces.items()}, outcomes=run.outcomes, facts=facts,
                        why_ended=f"the records of {rank_list(outcome.records_lost)} went with their lost node"
                        if outcome.records_lost else None,
                        # the replay (a subprocess) only where every compute() could finish
                        results=with_metric_reference(run.results, launch_dir)
                        if outcome.end_reason == EndReason.COMPLETED else run.results,
                        started_at=outcome.started_at, ended_at=outcome.ended_at)
    scenario = Scenario(name=spec.name, source=spec.source if isinstance(spec, ScriptSpec) else spec.file,
                        expected=spec.expect, description=spec.description, launch_dir=str(launch_dir))
    result = scenario_result(scenario, evidence, outcome.ended_at - outcome.started_at)
    result = dataclasses.replace(result, script=not isinstance(spec, ScenarioSpec))   # a script or a command
    if result.ok:
        return result
    log_rank = next((o.rank for o in run.outcomes.values() if o.state == RankState.CRASHED), 0)
    return dataclasses.replace(result, log_tail=tail(files.log(log_rank)))


def run_targets(specs: list[Target], options: RunOptions, hooks: RunHooks | None = None) -> Report:
    """Run every target (node 0 of a multi-node job writes the report); the report is saved
    in the run dir as well as returned."""
    hooks = hooks or RunHooks()
    if not specs:
        raise UsageError("nothing to run: no scenarios selected")
    if options.metric_memory_mb is not None:   # the ranks inherit it, however they are launched
        os.environ[metric_recording.MEMORY_ENV] = f"{options.metric_memory_mb:g}"
    user_code.declare(_named_files(specs))   # the ranks inherit it, however they are launched
    run_id = new_run_id()
    run_dir = make_run_dir(options.run_dir, run_id)
    interrupt.begin_run()   # from here Ctrl-C still ends with a report
    # Every node must name its launches alike for torch's rendezvous to pair them.
    launch_base = options.nodes.rdzv_id if options.nodes.multi else run_id
    check_endpoint_address(options.nodes)
    cluster = ClusterStore(options.nodes, note=hooks.note) if options.nodes.multi else None
    started = time.time()
    specs = unique_names([s.at_world_size(options.world_size) if isinstance(s, ScenarioSpec) else s for s in specs])
    state = _run_all(specs, options, run_dir, launch_base, cluster, hooks)
    output = None
    if isinstance(specs[0], CommandSpec):   # the report's world size is the one the command's ranks reported
        options = command_options(options, run_dir / specs[0].name)
        output = command_output_tail(LaunchFiles(run_dir / specs[0].name)) or None
    report = Report(run=run_info(options, run_dir, started, output), scenarios=tuple(state.results),
                    interrupted=state.interrupted)
    write_json_atomic(run_dir / REPORT_FILE, report.to_dict())
    if cluster is not None and cluster.liveness.lost:
        raise lost_nodes_error(cluster.liveness.lost, state.results[-1].name, len(specs) - len(state.results),
                               run_dir)
    return report


def _named_files(specs: list[Target]) -> list[str]:
    """The files the user named: a script, and the files and folders on a command's line."""
    named: list[str] = []
    for spec in specs:
        if isinstance(spec, CommandSpec):
            named += user_code.named_paths(spec.argv)
        elif isinstance(spec, ScriptSpec):
            named += ([spec.file] if spec.file else []) + user_code.named_paths(spec.args)
    return named


def _run_all(specs: list[Target], options: RunOptions, run_dir: Path, launch_base: str,
             cluster: ClusterStore | None, hooks: RunHooks) -> RunState:
    """Each unit of ``batch.plan`` in turn, until all ran or the run must stop."""
    state = RunState()
    started: list[str] = []

    def announce(spec: Target) -> None:   # counters go by the order scenarios start, not by name
        if spec.name not in started:
            started.append(spec.name)
            hooks.scenario_started(spec, len(started) - 1, len(specs))

    units = batch.plan(specs, batching=options.batching and not options.nodes.multi and not options.max_duration)
    batches = 0
    while units and not interrupt.requested():   # a Ctrl-C that came between launches
        unit = units.pop(0)
        try:
            if len(unit) == 1:
                announce(unit[0])
                results, leftover = run_unit(unit[0], options, run_dir / unit[0].name, launch_base,
                                             hooks.on_poll, cluster, hooks.rank_output), []
            else:
                batches += 1
                results, leftover = run_batch(unit, options, run_dir, f"batch-{batches}", launch_base, hooks.on_poll,
                                              announce)
        except KeyboardInterrupt:
            state.interrupted = True
            break
        for result in results:
            state.results.append(result)
            hooks.scenario_finished(result)
        if leftover:   # what a failed batch never reached runs next; with no progress at all, each alone
            units[0:0] = [leftover] if results else [[s] for s in leftover]
        if _must_stop(results, state, cluster):
            break
    state.interrupted = state.interrupted or interrupt.requested()
    return state   # results in the order they ran


def _must_stop(results: list[ScenarioResult], state: RunState, cluster: ClusterStore | None) -> bool:
    """Ctrl-C, the global --timeout, or a lost node ends the whole run, not just one launch."""
    if interrupt.requested() or any(EndReason.of(r.end_reason).interrupted for r in results):
        state.interrupted = True
        return True
    if any(r.end_reason == EndReason.TIMEOUT for r in results):
        return True
    return cluster is not None and bool(cluster.liveness.lost)


def lost_nodes_error(lost: list[int], scenario: str, not_run: int, run_dir: Path) -> LaunchError:
    nodes = ", ".join(map(str, lost))
    return LaunchError(
        f"node {nodes} went silent during {scenario} (its distcheck was killed, or its machine lost) before "
        f"sending its ranks' traces; {plural(not_run, 'scenario')} did not run",
        f"the report so far, without those ranks' traces, is {run_dir / REPORT_FILE}; "
        f"their traces stay in the run dir on node {nodes}")


def unique_names(specs: list[Target]) -> list[Target]:
    """Scenario names name launch directories: a repeated name gets a suffix."""
    seen: set[str] = set()
    out = []
    for i, spec in enumerate(specs):
        if spec.name in seen:
            spec = dataclasses.replace(spec, name=f"{spec.name}-{i}")
        seen.add(spec.name)
        out.append(spec)
    return out


def run_batch(unit: list[ScenarioSpec], options: RunOptions, run_dir: Path, batch_name: str, run_id: str,
              on_poll: Callable | None, announce: Callable[[ScenarioSpec], None] = lambda spec: None,
              ) -> tuple[list[ScenarioResult], list[ScenarioSpec]]:
    """Several scenarios in one launch; returns their results and the ones it never reached.
    ``announce`` is told when each scenario starts."""
    results = [skipped_result(s, reason) for s in unit
               if (reason := skip_reason(s, options.backend, options.nproc_per_node))]
    runnable = [s for s in unit if not skip_reason(s, options.backend, options.nproc_per_node)]
    if len(runnable) <= 1:
        for s in runnable:
            announce(s)
        return results + [run_scenario(s, options, run_dir / s.name, run_id, on_poll) for s in runnable], []
    batch_dir = run_dir / batch_name
    rundir.prepare_launch_dir(batch_dir)
    follower = batch.ScenarioFollower(LaunchFiles(batch_dir), runnable, announce)
    follower.start()

    def poll(progress: dict, idle_s: float) -> None:
        follower.poll()
        if on_poll is not None:
            on_poll(progress, idle_s)

    outcome = launch(launch_spec(options, batch_dir, worker_args(runnable, options, batch_dir), run_id,
                                 scenario=True), on_poll=poll)
    parts = batch.split(LaunchFiles(batch_dir), runnable, options.world_size, outcome, run_dir)
    done = parts.completed + ([parts.failed] if parts.failed else [])
    follower.finish({spec.name for spec, _, _ in done})
    results += [result_of_launch(spec, options, launch_dir, o) for spec, launch_dir, o in done]
    return results, parts.not_started


def skipped_result(spec: ScenarioSpec, reason: str) -> ScenarioResult:
    return ScenarioResult(name=spec.name, source=spec.file, expected=spec.expect, observed=(), ok=True,
                          duration_s=0.0, skipped=reason, description=spec.description,
                          end_reason=EndReason.NOTHING_RAN)


def run_info(options: RunOptions, run_dir: Path, started: float, command_output: str | None = None) -> RunInfo:
    import torch

    from distcheck.launch.slurm import slurm_job
    from distcheck.torch_features import features

    info = build_run_info(
        backend=options.backend, world_size=options.world_size, nnodes=options.nodes.nnodes,
        nproc_per_node=options.nproc_per_node, torch_version=torch.__version__,
        command=options.command or shlex.join(sys.argv), run_dir=str(run_dir), seed=options.seed,
        started=started, ended=time.time(), versions=library_versions(), command_output=command_output,
    )
    job = slurm_job()
    return dataclasses.replace(info, torch_features=features().flags(), slurm=job.metadata() if job else {})
