"""Running targets end to end: launches (shared by scenarios where they can be, see
``batch``), then collection and analysis of what every rank left behind.

This is the library behind ``distcheck run``; the CLI only parses options.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import platform
import secrets
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distcheck import __version__
from distcheck.launch import batch
from distcheck.files import run_dir as rundir
from distcheck.diagnose.rules import RunFacts, analyze, behaved_as_expected, collectives_compared, observed_kinds
from distcheck.errors import LaunchError, UsageError
from distcheck.diagnose.health import first_tables, health_findings
from distcheck.launch.cluster import ClusterStore, NodeConfig, check_endpoint_address, node_address
from distcheck.launch.launcher import LaunchOutcome, LaunchSpec, RankFailure, launch
from distcheck.models import Report, RunInfo, ScenarioResult
from distcheck.discovery import ScriptSpec, Target
from distcheck.diagnose.collect import CollectedRun, collect
from distcheck.files.launch_dir import LaunchFiles, write_json_atomic
from distcheck.scenario import ScenarioSpec
from distcheck.text import plural
from distcheck.launch.watchdog import Limits

OPTIONAL_LIBRARIES = ("torchmetrics", "lightning")
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class RunOptions:
    nproc_per_node: int
    backend: str                    # resolved: gloo or nccl
    device: str = "auto"
    stall_timeout: float = 10.0
    timeout: float | None = None
    max_duration: float | None = None
    seed: int = 0
    run_dir: Path | None = None
    command: str = ""
    nodes: NodeConfig = NodeConfig()
    batching: bool = True            # all but expected hangs/crashes share a launch (see batch.plan)
    scenario_options: tuple[tuple[str, str], ...] = ()   # passed to every scenario as ctx.options
    flight_recorder: bool | None = None   # None: on for NCCL (GPU-side state), off for gloo

    @property
    def world_size(self) -> int:
        return self.nodes.nnodes * self.nproc_per_node


@dataclass
class RunHooks:
    """Callbacks the terminal live view plugs into."""

    scenario_started: Callable[[ScenarioSpec, int, int], None] = lambda spec, i, n: None
    scenario_finished: Callable[[ScenarioResult], None] = lambda result: None
    on_poll: Callable | None = None
    note: Callable[[str], None] = lambda text: None      # what distcheck itself is waiting for


@dataclass
class RunState:
    results: list[ScenarioResult] = field(default_factory=list)
    interrupted: bool = False


def new_run_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_run_dir(run_dir: Path | None, run_id: str) -> Path:
    """Writable (a real write), private (0700) when created; LaunchError before any launch otherwise."""
    return rundir.make_run_dir(run_dir or Path(".distcheck") / "runs" / run_id)


def missing_requirements(spec: ScenarioSpec) -> list[str]:
    return [name for name in spec.requires if importlib.util.find_spec(name) is None]


def skip_reason(spec: ScenarioSpec, options: RunOptions) -> str | None:
    missing = missing_requirements(spec)
    if missing:
        extra = "'distcheck[metrics]'" if set(missing) <= set(OPTIONAL_LIBRARIES) else " ".join(missing)
        return f"needs {', '.join(missing)}, which is not installed (pip install {extra})"
    if options.backend not in spec.backends:
        return f"only meaningful on {'/'.join(spec.backends)}; this run uses {options.backend}"
    if options.nproc_per_node < spec.min_world_size:
        return f"needs at least {spec.min_world_size} ranks; this run has {options.nproc_per_node}"
    return None


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


def worker_args(spec: Target | list[ScenarioSpec], options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
    """``python -m distcheck.rank.worker`` arguments for a script, a scenario, or a batch of scenarios."""
    common = ("--launch-dir", str(launch_dir), "--backend", options.backend, "--device", options.device,
              "--seed", str(options.seed), "--pg-timeout", str(pg_timeout(options)))
    if isinstance(spec, ScriptSpec):
        what = ("--module", spec.module) if spec.module else ("--script", spec.file)
        return (*common, *what, "--", *spec.args)
    opts = tuple(a for key, value in options.scenario_options for a in ("--option", f"{key}={value}"))
    specs = spec if isinstance(spec, list) else [spec]
    pairs = tuple(a for s in specs for a in ("--scenario-file", s.file, "--scenario-name", s.name))
    return (*common, *opts, *pairs)


def check_script_was_distributed(spec: Target, run: CollectedRun, end_reason: str) -> None:
    """A .py file that never touched torch.distributed is neither a scenario nor a job."""
    if not isinstance(spec, ScriptSpec) or end_reason != "completed":
        return
    statuses = [o for o in run.outcomes.values()]
    if run.traces and any(t.events for t in run.traces.values()):
        return
    if statuses and all(o.state == "finished" for o in statuses) and not run.initialized_process_group:
        raise UsageError(
            f"{spec.source} ran to the end on every rank without calling init_process_group, "
            "and it has no @scenario function: there was nothing to check",
            "point distcheck at a distributed script, or decorate scenario functions with @distcheck.scenario",
        )


def run_scenario(spec: Target, options: RunOptions, launch_dir: Path, run_id: str,
                 on_poll: Callable | None = None, cluster: ClusterStore | None = None) -> ScenarioResult:
    reason = None if isinstance(spec, ScriptSpec) else skip_reason(spec, options)
    if reason:
        return skipped_result(spec, reason)
    rundir.prepare_launch_dir(launch_dir)   # a re-used --run-dir: nothing stale mixes into this launch
    nodes = options.nodes
    channel = cluster.launch(launch_dir.name, options.world_size) if cluster is not None else None
    outcome = launch(launch_spec(options, launch_dir, worker_args(spec, options, launch_dir), run_id, channel),
                     on_poll=on_poll)
    files = LaunchFiles(launch_dir)
    if channel is not None:
        channel.upload(files, launch_summary(outcome))
        if not channel.is_leader:   # node 0 writes the report; this node returns its verdict
            return ScenarioResult.from_dict(channel.result(timeout_s=nodes.rdzv_timeout + 60))
        outcome = merge_node_summaries(outcome, channel.gather(files, timeout_s=nodes.rdzv_timeout + 60))
    result = result_of_launch(spec, options, launch_dir, outcome)
    if channel is not None:
        channel.post_result(result.to_dict())
    return result


def launch_spec(options: RunOptions, launch_dir: Path, args: tuple[str, ...], run_id: str,
                channel: Any = None) -> LaunchSpec:
    nodes = options.nodes
    limits = Limits(stall_timeout=options.stall_timeout, timeout=options.timeout, max_duration=options.max_duration)
    return LaunchSpec(launch_dir=launch_dir, nproc_per_node=options.nproc_per_node, backend=options.backend,
                      worker_args=args, limits=limits, run_id=f"{run_id}-{launch_dir.name}", device=options.device,
                      rdzv_endpoint=nodes.rdzv_endpoint, nnodes=nodes.nnodes, node_rank=nodes.node_rank,
                      local_addr=node_address(nodes), rdzv_timeout=nodes.rdzv_timeout, channel=channel,
                      flight_recorder=options.flight_recorder if options.flight_recorder is not None
                      else options.backend == "nccl")


def result_of_launch(spec: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome) -> ScenarioResult:
    """Collect what the ranks left in ``launch_dir`` and analyze it (the pure part is ``analysis``)."""
    source = spec.source if isinstance(spec, ScriptSpec) else spec.file
    files = LaunchFiles(launch_dir)
    run = collect(files, options.world_size, outcome)
    check_script_was_distributed(spec, run, outcome.end_reason)
    facts = RunFacts(world_size=options.world_size, end_reason=outcome.end_reason,
                     stall_onset=outcome.watchdog.stall_onset, detected_at=outcome.watchdog.detected_at,
                     timeout_s=options.timeout, oom_kills=outcome.oom_kills)
    events = {r: t.events for r, t in run.traces.items()}
    findings = analyze(events, run.outcomes, facts, run.results) + health_findings(run.results)
    observed = observed_kinds(findings)
    ok = behaved_as_expected(spec.expect, observed) and outcome.end_reason != "interrupted"
    log_rank = next((o.rank for o in run.outcomes.values() if o.state == "crashed"), 0)
    result = ScenarioResult(
        name=spec.name, source=source, expected=spec.expect, observed=observed, ok=ok,
        duration_s=outcome.ended_at - outcome.started_at, findings=tuple(findings),
        ranks=tuple(run.outcomes[r] for r in sorted(run.outcomes)), end_reason=outcome.end_reason,
        launch_dir=str(launch_dir), description=spec.description,
        collectives_compared=collectives_compared(events),
        log_tail=None if ok else tail(files.log(log_rank)), tables=first_tables(run.results),
        started_at=outcome.started_at, ended_at=outcome.ended_at,
        stall_onset=outcome.watchdog.stall_onset, detected_at=outcome.watchdog.detected_at,
    )
    return result


def launch_summary(outcome: LaunchOutcome) -> dict:
    """What node 0 needs from another node's launch (JSON-ready)."""
    w = outcome.watchdog
    return {
        "end_reason": outcome.end_reason,
        "failures": {str(r): [f.exit_code, f.signal, f.pid] for r, f in outcome.failures.items()},
        "killed_ranks": list(w.killed_ranks),
        "oom_kills": outcome.oom_kills,
    }


END_REASON_PRIORITY = ("interrupted", "stall", "timeout", "max_duration", "crash", "completed")


def merge_node_summaries(outcome: LaunchOutcome, summaries: list[dict]) -> LaunchOutcome:
    """Node 0's view of the whole job: every node's failures and the ranks it killed."""
    w = outcome.watchdog
    reasons = [outcome.end_reason] + [s["end_reason"] for s in summaries]
    failures = dict(outcome.failures)
    for s in summaries:
        failures.update({int(r): RankFailure(*f) for r, f in s["failures"].items()})
        w.killed_ranks = tuple(sorted(set(w.killed_ranks) | set(s["killed_ranks"])))
    end_reason = min(reasons, key=lambda r: END_REASON_PRIORITY.index(r) if r in END_REASON_PRIORITY else 99)
    counts = [c for c in [outcome.oom_kills] + [s.get("oom_kills") for s in summaries] if c is not None]
    return dataclasses.replace(outcome, failures=failures, end_reason=end_reason,
                               oom_kills=sum(counts) if counts else None)


def pg_timeout(options: RunOptions) -> float:
    """Above the stall timeout, so distcheck diagnoses before the backend aborts."""
    return max(options.stall_timeout * 4 + 60, (options.timeout or 0) + 60, 300)


def run_targets(specs: list[Target], options: RunOptions, hooks: RunHooks | None = None) -> Report:
    hooks = hooks or RunHooks()
    if not specs:
        raise UsageError("nothing to run: no scenarios selected")
    run_id = new_run_id()
    run_dir = make_run_dir(options.run_dir, run_id)
    # Every node must name its launches alike for torch's rendezvous to pair them.
    launch_base = options.nodes.rdzv_id if options.nodes.multi else run_id
    check_endpoint_address(options.nodes)
    cluster = ClusterStore(options.nodes, note=hooks.note) if options.nodes.multi else None
    started = time.time()
    state = RunState()
    specs = unique_names(specs)
    position = {s.name: i for i, s in enumerate(specs)}
    units = batch.plan(specs, batching=options.batching and not options.nodes.multi and not options.max_duration)
    batches = 0
    while units:
        unit = units.pop(0)
        hooks.scenario_started(unit[0], position[unit[0].name], len(specs))
        try:
            if len(unit) == 1:
                results, leftover = [run_scenario(unit[0], options, run_dir / unit[0].name, launch_base,
                                                  hooks.on_poll, cluster)], []
            else:
                batches += 1
                results, leftover = run_batch(unit, options, run_dir, f"batch-{batches}", launch_base, hooks.on_poll)
        except KeyboardInterrupt:
            state.interrupted = True
            break
        for result in results:
            state.results.append(result)
            hooks.scenario_finished(result)
        if leftover:   # what a failed batch never reached runs next; with no progress at all, each alone
            units[0:0] = [leftover] if results else [[s] for s in leftover]
        if any(r.end_reason == "interrupted" for r in results):
            state.interrupted = True
            break
        if any(r.end_reason == "timeout" for r in results):
            break
        if cluster is not None and cluster.liveness.lost:
            break
    state.results.sort(key=lambda r: position.get(r.name, len(position)))
    report = Report(run=run_info(options, run_dir, started), scenarios=tuple(state.results),
                    interrupted=state.interrupted)
    write_json_atomic(run_dir / "report.json", report.to_dict())
    if cluster is not None and cluster.liveness.lost:
        raise lost_nodes_error(cluster.liveness.lost, state.results[-1].name, len(specs) - len(state.results),
                               run_dir)
    return report


def lost_nodes_error(lost: list[int], scenario: str, not_run: int, run_dir: Path) -> LaunchError:
    nodes = ", ".join(map(str, lost))
    return LaunchError(
        f"node {nodes} went silent during {scenario} (its distcheck was killed, or its machine lost) before "
        f"sending its ranks' traces; {plural(not_run, 'scenario')} did not run",
        f"the report so far, without those ranks' traces, is {run_dir / 'report.json'}; "
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
              on_poll: Callable | None) -> tuple[list[ScenarioResult], list[ScenarioSpec]]:
    """Several scenarios in one launch; returns their results and the ones it never reached."""
    results = [skipped_result(s, reason) for s in unit if (reason := skip_reason(s, options))]
    runnable = [s for s in unit if not skip_reason(s, options)]
    if len(runnable) <= 1:
        return results + [run_scenario(s, options, run_dir / s.name, run_id, on_poll) for s in runnable], []
    batch_dir = run_dir / batch_name
    rundir.prepare_launch_dir(batch_dir)
    outcome = launch(launch_spec(options, batch_dir, worker_args(runnable, options, batch_dir), run_id), on_poll=on_poll)
    parts = batch.split(LaunchFiles(batch_dir), runnable, options.world_size, outcome, run_dir)
    done = parts.completed + ([parts.failed] if parts.failed else [])
    results += [result_of_launch(spec, options, launch_dir, o) for spec, launch_dir, o in done]
    return results, parts.not_started


def skipped_result(spec: ScenarioSpec, reason: str) -> ScenarioResult:
    return ScenarioResult(name=spec.name, source=spec.file, expected=spec.expect, observed=(), ok=True,
                          duration_s=0.0, skipped=reason, description=spec.description)


def run_info(options: RunOptions, run_dir: Path, started: float) -> RunInfo:
    import torch

    return RunInfo(
        backend=options.backend, world_size=options.world_size, nnodes=options.nodes.nnodes,
        nproc_per_node=options.nproc_per_node, torch_version=torch.__version__,
        distcheck_version=__version__, command=options.command or shlex.join(sys.argv),
        run_dir=str(run_dir), seed=options.seed, duration_s=time.time() - started,
        started_at=datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        hostname=socket.gethostname(), python_version=platform.python_version(), versions=library_versions(),
    )


def resolve_backend(backend: str, nproc_per_node: int) -> str:
    """auto: NCCL when there is a GPU per rank, else gloo on CPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= nproc_per_node and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not torch.distributed.is_nccl_available() or gpus == 0:
            raise UsageError("--backend nccl needs CUDA GPUs, and this machine has none",
                             "use --backend gloo (or auto) on a CPU-only machine")
        if gpus < nproc_per_node:
            raise UsageError(f"--backend nccl needs one GPU per rank: {nproc_per_node} ranks, {gpus} GPUs",
                             f"use --nproc-per-node {gpus}, or --backend gloo")
    return backend
