"""The one path from what a launch left to its ``ScenarioResult``: findings →
observed kinds → verdict. A live run (``session``), a run dir read back and
Flight Recorder dumps (``postmortem``) all end here. Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distcheck.diagnose.facts import Facts, facts_of
from distcheck.diagnose.rules import RunFacts, behaved_as_expected, collectives_compared, judge, observed_kinds
from distcheck.diagnose.blame import attribute_by_majority
from distcheck.diagnose.health import first_tables, health_findings
from distcheck.errors import ExitCode
from distcheck.models import (PASS, VERSION, EndReason, Event, Expectation, Finding, Kind, RankOutcome, Report, RunInfo,
                              ScenarioResult, Severity)
from distcheck.text import rank_list


@dataclass(frozen=True)
class Scenario:
    """What was run and what it should do."""

    name: str
    source: str
    expected: tuple[Expectation, ...] = (PASS,)
    description: str | None = None
    launch_dir: str | None = None


@dataclass(frozen=True)
class Evidence:
    """What the ranks left, however it was gathered, and how the launch ended."""

    events: Mapping[int, Sequence[Event]]
    outcomes: Mapping[int, RankOutcome]
    facts: RunFacts
    results: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    started_at: float | None = None
    ended_at: float | None = None
    why_ended: str | None = None    # what distcheck saw when it ended the run itself


@dataclass(frozen=True)
class Blame:
    """A post-mortem: hangs name their odd side by majority; these ranks cannot be judged."""

    missing: tuple[int, ...] = ()      # left no dump
    cut_short: tuple[int, ...] = ()    # left a partial one


def scenario_result(scenario: Scenario, evidence: Evidence, duration_s: float,
                    blame: Blame | None = None) -> ScenarioResult:
    """The verdict on one launch. ``blame`` is None for a live run, which also checks
    the scenario's health requirements and keeps its tables."""
    facts = evidence.facts
    seen = facts_of(evidence.events, evidence.outcomes, facts, evidence.results)   # its table read once, for both
    findings = _findings(evidence, seen, blame)
    observed = observed_kinds(findings)
    # An interrupted live run never passes, nor one distcheck cut short (but for a pre-flight's window); a
    # post-mortem judges only what the files say.
    ended = EndReason.of(facts.end_reason)
    cut_short = ended.by_distcheck and ended is not EndReason.MAX_DURATION and tuple(scenario.expected) == (PASS,)
    ok = behaved_as_expected(scenario.expected, observed) and (blame is not None or not (ended.interrupted
                                                                                         or cut_short))
    return ScenarioResult(
        name=scenario.name, source=scenario.source, expected=scenario.expected, observed=observed, ok=ok,
        duration_s=duration_s, findings=tuple(findings),
        ranks=tuple(evidence.outcomes[r] for r in sorted(evidence.outcomes)), end_reason=facts.end_reason,
        launch_dir=scenario.launch_dir, description=scenario.description,
        collectives_compared=collectives_compared(seen.table),
        tables=first_tables(evidence.results) if blame is None else (),
        started_at=evidence.started_at, ended_at=evidence.ended_at,
        stall_onset=facts.stall_onset, detected_at=facts.detected_at,
    )


def _findings(evidence: Evidence, seen: Facts, blame: Blame | None) -> list[Finding]:
    findings = judge(seen)
    if blame is None:
        findings = findings + health_findings(evidence.results)
        findings = findings + ended_by_distcheck(evidence.facts, findings, evidence.why_ended)
        return findings + unexplained_failure(evidence.facts, evidence.outcomes, findings)
    return attribute_by_majority(findings, blame.missing, blame.cut_short)


def ended_by_distcheck(facts: RunFacts, findings: Sequence[Finding], why: str | None = None) -> list[Finding]:
    """A live run that distcheck ended (a stall, --timeout), or one whose node was lost with its ranks'
    records, while no error finding says why: say so, so the run is not reported as a pass (the records
    left may simply show nothing open, or only the survivors' errors as reactions to their lost peers)."""
    # Ends distcheck itself decides (EndReason.by_distcheck): such a run is never a pass, whatever the records show.
    ended = EndReason.of(facts.end_reason)
    if not (ended.by_distcheck or facts.records_lost) or any(f.severity is Severity.ERROR for f in findings):
        return []
    if any(f.data.get("during_startup") for f in findings):   # said already: cut during start-up, nothing checked
        return []
    what = ended.words.removeprefix("ended ")
    if not ended.by_distcheck:   # a lost node: it ended the run, and what its ranks did went with it
        lost = why or f"the records of {rank_list(facts.records_lost)} went with their lost node"
        return [Finding(kind=Kind.CRASH, severity=Severity.ERROR, data={"ended_by": str(facts.end_reason)},
                        summary=(f"This run did not finish ({what}): {lost}, so nothing says what they did "
                                 "and the run did not pass. Their node's own launch dir, and its output, "
                                 "may show how far they got."))]
    if why is None and ended is EndReason.TIMEOUT:
        why = f"the run took longer than {facts.timeout_s:g} s" if facts.timeout_s else "the run took too long"
    reason = why or (f"no progress for {facts.stall_timeout_s:g} s" if facts.stall_timeout_s else "no progress")
    return [Finding(kind=Kind.HANG, severity=Severity.ERROR, data={"ended_by": str(facts.end_reason)},
                    summary=(f"distcheck ended this run itself ({what}: {reason}), though no rank was seen "
                             "waiting inside a collective: the run did not finish, so it did not pass. "
                             "Its output, in logs/ of the launch dir, shows how far it got."))]


def unexplained_failure(facts: RunFacts, outcomes: Mapping[int, RankOutcome],
                        findings: Sequence[Finding]) -> list[Finding]:
    """A live run that ended because a rank failed, while no error finding says why: the failure itself,
    so the run is never a pass (a rank's exit status is its job's, whatever the records show)."""
    if facts.end_reason != EndReason.CRASH or any(f.severity is Severity.ERROR for f in findings):
        return []
    failed = [o for _, o in sorted(outcomes.items()) if o.exit_code not in (None, 0) or o.signal]
    failed = [o for o in failed if o.signal != "SIGTERM"] or failed   # the launcher's SIGTERMs came after
    if not failed:
        return []
    first = failed[0]
    how = f"was killed by {first.signal}" if first.signal else f"exited with code {first.exit_code}"
    said = f" ({first.exception})" if first.exception else ""
    return [Finding(kind=Kind.CRASH, severity=Severity.ERROR, odd_ranks=(first.rank,), callsite=first.where,
                    data={"root_rank": first.rank, "exit_code": first.exit_code, "signal": first.signal},
                    summary=(f"Rank {first.rank} {how}{said}, and no collective record explains it: the job "
                             f"failed, so it did not pass. Its log, in logs/ of the launch dir, shows why."))]


def merge_results(parts: Sequence[ScenarioResult]) -> ScenarioResult:
    """One verdict from several generations of ranks that served one test (or one command): every
    finding of each, and the ranks of the first generation that went wrong (else of the last)."""
    if len(parts) == 1:
        return parts[0]
    shown = next((p for p in parts if not p.ok), parts[-1])
    findings = tuple(f for p in parts for f in p.findings)
    return dataclasses.replace(
        shown, findings=findings, observed=observed_kinds(list(findings)), ok=all(p.ok for p in parts),
        duration_s=sum(p.duration_s for p in parts),
        collectives_compared=sum(p.collectives_compared for p in parts),
        tables=tuple(t for p in parts for t in p.tables),
        started_at=min((p.started_at for p in parts if p.started_at is not None), default=None),
        ended_at=max((p.ended_at for p in parts if p.ended_at is not None), default=None),
        description=f"{shown.description or shown.name} ({len(parts)} generations of ranks)",
    )


def command_ended(scenario: Scenario, end_reason: str, command_exit: int | None, why: str | None, *,
                  explained: bool, started_at: float, ended_at: float) -> ScenarioResult | None:
    """The command's own verdict beside its tests': only where nothing else explains how it ended —
    distcheck ended it (a stall between generations, --timeout), or it exited non-zero while every
    test's ranks were clean (a test without ranks failed, or the runner did)."""
    ended_by_us = EndReason.of(end_reason).by_distcheck
    # its exit code is distcheck's doing
    if EndReason.of(end_reason).interrupted or end_reason == EndReason.MAX_DURATION:
        return None
    if not ended_by_us and (explained or command_exit in (None, 0)):
        return None
    if ended_by_us and explained and why is None:
        return None
    facts = RunFacts(world_size=0, end_reason=end_reason, command_exit=command_exit)
    evidence = Evidence(events={}, outcomes={}, facts=facts, started_at=started_at, ended_at=ended_at,
                        why_ended=why)
    return scenario_result(scenario, evidence, ended_at - started_at)


def run_info(*, backend: str, world_size: int, nnodes: int, nproc_per_node: int, torch_version: str,
             command: str, run_dir: str, seed: int, started: float, ended: float,
             versions: dict[str, str], command_output: str | None = None) -> RunInfo:
    """The run's header; this machine and this distcheck fill in the rest."""
    return RunInfo(
        backend=backend, world_size=world_size, nnodes=nnodes, nproc_per_node=nproc_per_node,
        torch_version=torch_version, distcheck_version=VERSION, command=command, run_dir=run_dir,
        seed=seed, duration_s=ended - started,
        started_at=datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        hostname=socket.gethostname(), python_version=platform.python_version(), versions=versions,
        command_output=command_output,
    )


def exit_code(report: Report) -> ExitCode:
    """What a run's report means as distcheck's exit code (``ExitCode``); a wrapped command with no process group
    exits with its own code."""
    if report.interrupted:
        return ExitCode.INTERRUPTED
    if any(s.end_reason == EndReason.TIMEOUT for s in report.scenarios):
        return ExitCode.TIMEOUT
    if report.unchecked_exit is not None:
        return report.unchecked_exit   # type: ignore[return-value]   # the command's own code, not one of ours
    if report.nothing_ran:
        return ExitCode.NOTHING_RAN
    return ExitCode.OK if report.verdict == "pass" else ExitCode.FINDINGS
