"""What every kind of target shares: the launch it asks torch's launcher for, the worker's common
arguments, and the one path from a finished launch to its ``ScenarioResult`` (collected, judged by
``diagnose.verdict``, and on several nodes judged by node 0 alone)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from distcheck.diagnose.rules import RunFacts
from distcheck.evidence.collect import CollectedRun, collect
from distcheck.diagnose.verdict import Evidence, Scenario, scenario_result
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.trace_reader import no_cycle_collection
from distcheck.launch import forkserver
from distcheck.launch.node_config import node_address
from distcheck.launch.launcher import LaunchOutcome, LaunchSpec, merge_node_summaries, node_summary
from distcheck.launch.replay import metric_reference
from distcheck.launch.watchdog import Limits, NodeChannel
from distcheck.models import EndReason, RankState, ScenarioResult
from distcheck.options import RunOptions, pg_timeout
from distcheck.targets import Target
from distcheck.text import rank_list

if TYPE_CHECKING:
    from distcheck.launch.cluster import LaunchChannel

LOG_TAIL_LINES = 40


def worker_common_args(options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
    """The part of ``python -m distcheck.rank.worker``'s argv every target shares (the worker parses it)."""
    return ("--launch-dir", str(launch_dir), "--backend", options.backend, "--device", options.device,
            "--seed", str(options.seed), "--pg-timeout", str(pg_timeout(options)))


def limits_of(options: RunOptions) -> Limits:
    return Limits(stall_timeout=options.stall_timeout, busy_timeout=options.busy_timeout, timeout=options.timeout,
                  max_duration=options.max_duration)


def launch_spec(options: RunOptions, launch_dir: Path, args: tuple[str, ...], run_id: str,
                channel: NodeChannel | None = None, forked: bool = False) -> LaunchSpec:
    """``forked``: the ranks are forked from a server that imported torch, where the installed torch
    allows (``launch.forkserver``); otherwise they get processes of their own."""
    nodes = options.nodes
    return LaunchSpec(launch_dir=launch_dir, nproc_per_node=options.nproc_per_node, backend=options.backend,
                      worker_args=args, limits=limits_of(options), run_id=f"{run_id}-{launch_dir.name}",
                      device=options.device, rdzv_endpoint=nodes.rdzv_endpoint, nnodes=nodes.nnodes,
                      node_rank=nodes.node_rank, local_addr=node_address(nodes), rdzv_timeout=nodes.rdzv_timeout,
                      channel=channel, flight_recorder=options.flight_recorder is not False,
                      forked=forked and forkserver.available(), env=options.rank_env)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def skipped_result(target: Target, reason: str) -> ScenarioResult:
    return ScenarioResult(name=target.name, source=target.source, expected=target.expect, observed=(), ok=True,
                          duration_s=0.0, skipped=reason, description=target.description,
                          end_reason=EndReason.NOTHING_RAN)


def judged_across_nodes(target: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome,
                        channel: LaunchChannel | None) -> ScenarioResult:
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
    result = result_of_launch(target, options, launch_dir, outcome)
    if channel is not None:
        channel.post_result(result)
    return result


def result_of_launch(target: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome) -> ScenarioResult:
    """Collect what the ranks left in ``launch_dir``, replay their metrics, then judge it: every fact is in
    before judging starts (the pure part is ``diagnose.verdict``)."""
    files = LaunchFiles(launch_dir)
    # millions of objects, few cycles: the collector's passes were a quarter of node 0's judgment at 4,096 ranks
    with no_cycle_collection():
        run = collect(files, options.world_size, outcome)
    target.check_collected(run, outcome.end_reason)
    # the single-process replay (a subprocess) only where every compute() could finish
    reference = metric_reference(run.results, launch_dir) if outcome.end_reason == EndReason.COMPLETED else None
    with no_cycle_collection():
        result = judged(target, options, launch_dir, outcome, run, reference)
    if result.ok:
        return result
    log_rank = next((o.rank for o in run.outcomes.values() if o.state == RankState.CRASHED), 0)
    return dataclasses.replace(result, log_tail=tail(files.log(log_rank)))


def judged(target: Target, options: RunOptions, launch_dir: Path, outcome: LaunchOutcome, run: CollectedRun,
           reference: dict | None) -> ScenarioResult:
    """The verdict on a collected launch, from facts alone (``reference``: the metric replay's answer)."""
    facts = RunFacts(world_size=options.world_size, end_reason=outcome.end_reason,
                     stall_onset=outcome.watchdog.stall_onset, detected_at=outcome.watchdog.detected_at,
                     timeout_s=options.timeout, stall_timeout_s=options.stall_timeout, oom_kills=outcome.oom_kills,
                     command_exit=outcome.command_exit, evidence=outcome.watchdog.evidence,
                     late_evidence=outcome.watchdog.late_evidence, records_lost=outcome.records_lost,
                     elided={r: t.elided for r, t in run.traces.items() if t.elided},
                     waited={r: t.waited for r, t in run.traces.items() if t.waited},
                     after_decision=run.after_decision, metric_reference=reference)
    evidence = Evidence(events={r: t.events for r, t in run.traces.items()}, outcomes=run.outcomes, facts=facts,
                        why_ended=f"the records of {rank_list(outcome.records_lost)} went with their lost node"
                        if outcome.records_lost else None,
                        results=run.results, started_at=outcome.started_at, ended_at=outcome.ended_at)
    scenario = Scenario(name=target.name, source=target.source, expected=target.expect,
                        description=target.description, launch_dir=str(launch_dir))
    return dataclasses.replace(scenario_result(scenario, evidence, outcome.ended_at - outcome.started_at),
                               script=target.script)
