"""The one path from what a launch left to its ``ScenarioResult``: findings →
observed kinds → verdict. A live run (``session``), a run dir read back and
Flight Recorder dumps (``postmortem``) all end here. Pure.
"""

from __future__ import annotations

import datetime
import platform
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from distcheck import __version__
from distcheck.diagnose.analyze import RunFacts, analyze, behaved_as_expected, collectives_compared, observed_kinds
from distcheck.diagnose.blame import attribute_by_majority
from distcheck.diagnose.health import first_tables, health_findings
from distcheck.models import EndReason, Event, Finding, RankOutcome, RunInfo, ScenarioResult


@dataclass(frozen=True)
class Scenario:
    """What was run and what it should do."""

    name: str
    source: str
    expected: tuple[str, ...] = ("pass",)
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
    findings = _findings(evidence, blame)
    observed = observed_kinds(findings)
    # An interrupted live run never passes; a post-mortem judges only what the files say.
    ok = behaved_as_expected(scenario.expected, observed) and (
        blame is not None or facts.end_reason != EndReason.INTERRUPTED)
    return ScenarioResult(
        name=scenario.name, source=scenario.source, expected=scenario.expected, observed=observed, ok=ok,
        duration_s=duration_s, findings=tuple(findings),
        ranks=tuple(evidence.outcomes[r] for r in sorted(evidence.outcomes)), end_reason=facts.end_reason,
        launch_dir=scenario.launch_dir, description=scenario.description,
        collectives_compared=collectives_compared(evidence.events),
        tables=first_tables(evidence.results) if blame is None else (),
        started_at=evidence.started_at, ended_at=evidence.ended_at,
        stall_onset=facts.stall_onset, detected_at=facts.detected_at,
    )


def _findings(evidence: Evidence, blame: Blame | None) -> list[Finding]:
    findings = analyze(evidence.events, evidence.outcomes, evidence.facts, evidence.results)
    if blame is None:
        return findings + health_findings(evidence.results)
    return attribute_by_majority(findings, blame.missing, blame.cut_short)


def run_info(*, backend: str, world_size: int, nnodes: int, nproc_per_node: int, torch_version: str,
             command: str, run_dir: str, seed: int, started: float, ended: float,
             versions: dict[str, str]) -> RunInfo:
    """The run's header; this machine and this distcheck fill in the rest."""
    return RunInfo(
        backend=backend, world_size=world_size, nnodes=nnodes, nproc_per_node=nproc_per_node,
        torch_version=torch_version, distcheck_version=__version__, command=command, run_dir=run_dir,
        seed=seed, duration_s=ended - started,
        started_at=datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        hostname=socket.gethostname(), python_version=platform.python_version(), versions=versions,
    )
