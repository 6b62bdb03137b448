"""Running targets end to end: each launch unit (``targets.shared.plan``: scenarios that can, share
one launch) runs itself (``Target.run``: launch, collect, judge), until all ran or the run must stop.

This is the library behind ``distcheck run``: ``run_targets`` is its entry point; the CLI
parses flags into ``options.RunOptions`` and renders what comes back.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import secrets
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from distcheck import interrupt
from distcheck.diagnose.verdict import run_info as build_run_info
from distcheck.errors import LaunchError, UsageError
from distcheck.files import user_code
from distcheck.files.run_home import runs_root
from distcheck.files.saved_runs import REPORT_FILE, write_report
from distcheck.launch import forkserver, procs, slurm
from distcheck.launch.cluster import ClusterStore
from distcheck.launch.node_config import check_endpoint_address
from distcheck.launch.launcher import quiet_native_warnings, workers_torch_environment
from distcheck.models import EndReason, Report, RunInfo, ScenarioResult
from distcheck.options import RunOptions, claim_run_dir
from distcheck.rank import metrics as metric_recording
from distcheck.scenario import OPTIONAL_LIBRARIES
from distcheck.targets import RunContext, Target
from distcheck.targets.shared import plan
from distcheck.text import plural


@dataclass
class RunHooks:
    """Callbacks the terminal live view plugs into."""

    scenario_started: Callable[[Target, int, int], None] = lambda target, i, n: None
    scenario_finished: Callable[[ScenarioResult], None] = lambda result: None
    on_poll: Callable | None = None
    note: Callable[[str], None] = lambda text: None      # what distcheck itself is waiting for
    rank_output: Callable[[int | None, str], None] | None = None   # a script's ranks' lines, as they write them


@dataclass
class RunState:
    results: list[ScenarioResult] = field(default_factory=list)
    interrupted: bool = False


def prepare_process() -> None:
    """Call first, before torch loads: process-wide settings a run depends on."""
    quiet_native_warnings()


def start_fork_server(targets: list[Target], flight_recorder: bool) -> None:
    """Before torch loads here: a run whose every target's ranks are forked gets its fork server
    from this process's own torch import (``forkserver.start_early``)."""
    if targets and all(t.forked for t in targets):
        forkserver.start_early(workers_torch_environment(flight_recorder))


def new_run_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_run_dir(run_dir: Path | None, run_id: str) -> Path:
    """Writable (a real write), private (0700) when created; LaunchError before any launch otherwise."""
    return claim_run_dir(run_dir or runs_root() / run_id)


def library_versions() -> dict[str, str]:
    out = {}
    for name in OPTIONAL_LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def rank_environment(options: RunOptions, targets: list[Target]) -> tuple[tuple[str, str], ...]:
    """What this run adds to every rank's environment, however the rank is launched: the metric recorder's cap,
    and the files the user named (their code wherever it lives, ``files.user_code``)."""
    env = {}
    if options.metric_memory_mb is not None:
        env[metric_recording.MEMORY_ENV] = f"{options.metric_memory_mb:g}"
    env.update(user_code.environment([f for t in targets for f in t.named_files()]))
    return tuple(env.items())


def run_targets(targets: list[Target], options: RunOptions, hooks: RunHooks | None = None) -> Report:
    """Run every target (node 0 of a multi-node job writes the report); the report is saved
    in the run dir as well as returned."""
    hooks = hooks or RunHooks()
    if not targets:
        raise UsageError("nothing to run: no scenarios selected")
    options = dataclasses.replace(options, rank_env=rank_environment(options, targets))
    user_code.declare([f for t in targets for f in t.named_files()])   # for this process's own reading of stacks
    run_id = new_run_id()
    run_dir = make_run_dir(options.run_dir, run_id)
    # From here Ctrl-C still ends with a report (a second one kills what distcheck started).
    interrupt.begin_run(functools.partial(procs.kill_descendants, grace_s=0.0))
    # Every node must name its launches alike for torch's rendezvous to pair them.
    launch_base = options.nodes.rdzv_id if options.nodes.multi and options.nodes.rdzv_id else run_id   # multi: set
    check_endpoint_address(options.nodes)
    with slurm.stop_before_end():   # inside a Slurm job with a time limit: the report is written before it
        cluster = ClusterStore(options.nodes, note=hooks.note) if options.nodes.multi else None
        started = time.time()
        targets = unique_names([t.at_world_size(options.world_size) for t in targets])
        state = _run_all(targets, RunContext(options, run_dir, launch_base, cluster, hooks.on_poll,
                                             hooks.rank_output), hooks)
        reported, output = targets[0].as_reported(options, run_dir)
        report = Report(run=run_info(reported, run_dir, started, output), scenarios=tuple(state.results),
                        interrupted=state.interrupted)
        write_report(run_dir, report)
    if cluster is not None and cluster.liveness.lost:
        raise lost_nodes_error(cluster.liveness.lost, state.results[-1].name, len(targets) - len(state.results),
                               run_dir)
    return report


def _run_all(targets: list[Target], ctx: RunContext, hooks: RunHooks) -> RunState:
    """Each launch unit in turn, until all ran or the run must stop."""
    state = RunState()
    started: list[str] = []

    def announce(target: Target) -> None:   # counters go by the order targets start, not by name
        if target.name not in started:
            started.append(target.name)
            hooks.scenario_started(target, len(started) - 1, len(targets))

    ctx = dataclasses.replace(ctx, announce=announce)
    options = ctx.options
    units = plan(targets, batching=options.batching and not options.nodes.multi and not options.max_duration)
    while units and not interrupt.requested():   # a Ctrl-C that came between launches
        try:
            ran = units.pop(0).run(ctx)
        except KeyboardInterrupt:
            state.interrupted = True
            break
        for result in ran.results:
            state.results.append(result)
            hooks.scenario_finished(result)
        units[0:0] = list(ran.not_reached)
        if _must_stop(ran.results, state, ctx.cluster):
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


def unique_names(targets: list[Target]) -> list[Target]:
    """Target names name launch directories: a repeated name gets a suffix."""
    seen: set[str] = set()
    out = []
    for i, target in enumerate(targets):
        if target.name in seen:
            target = target.renamed(f"{target.name}-{i}")
        seen.add(target.name)
        out.append(target)
    return out


def run_info(options: RunOptions, run_dir: Path, started: float, command_output: str | None = None) -> RunInfo:
    import torch

    from distcheck.torch_features import features

    info = build_run_info(
        backend=options.backend, world_size=options.world_size, nnodes=options.nodes.nnodes,
        nproc_per_node=options.nproc_per_node, torch_version=torch.__version__,
        command=options.command or shlex.join(sys.argv), run_dir=str(run_dir), seed=options.seed,
        started=started, ended=time.time(), versions=library_versions(), command_output=command_output,
    )
    return dataclasses.replace(info, torch_features=features().flags(), slurm=slurm.run_metadata())
