"""What ``distcheck run`` runs, behind one protocol: a scenario, the user's script, the user's own
launch command, and a launch several scenarios share. ``session`` runs each the same way
(``Target.run``) and never asks which kind it holds; ``shared.plan`` decides which share a launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from distcheck.models import Expectation, expectations

if TYPE_CHECKING:
    from distcheck.evidence.collect import CollectedRun
    from distcheck.launch.cluster import ClusterStore
    from distcheck.models import ScenarioResult
    from distcheck.options import RunOptions


@dataclass(frozen=True)
class RunContext:
    """What every target's run needs from the run around it."""

    options: RunOptions
    run_dir: Path
    run_id: str                       # what launches are named after (every node names them alike)
    cluster: ClusterStore | None = None
    on_poll: Callable | None = None
    on_output: Callable[[int | None, str], None] | None = None   # the ranks' lines (a command's own: None), as written
    announce: Callable[[Target], None] = lambda target: None   # a target's ranks start now


@dataclass(frozen=True)
class Ran:
    """What a target's run gave: its results, and (a shared launch) the targets it never reached."""

    results: list[ScenarioResult]
    not_reached: Sequence[Target] = field(default_factory=tuple)


class Target(Protocol):
    """One thing ``distcheck run`` runs and judges."""

    @property
    def name(self) -> str: ...

    @property
    def expect(self) -> tuple[Expectation, ...]: ...

    @property
    def description(self) -> str: ...

    @property
    def source(self) -> str: ...        # what the user named: a scenario's file, a script, a command line

    @property
    def script(self) -> bool: ...       # the user's own job (a script or a command), not a scenario

    @property
    def shares_launch(self) -> bool: ...   # may run in one launch with other targets

    @property
    def forked(self) -> bool: ...       # its ranks may be forked from a server that imported torch

    def headline(self, ranks: str) -> str: ...   # what the run's first line says when it runs alone

    def renamed(self, name: str) -> Target: ...

    def at_world_size(self, world_size: int) -> Target: ...   # what it expects at this rank count

    def named_files(self) -> list[str]: ...   # the user's files it names (their code wherever they live)

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]: ...
    # the options the report states (a command's ranks report their world size), and the command's output

    def check_collected(self, run: CollectedRun, end_reason: str) -> None: ...   # UsageError: nothing to judge

    def run(self, ctx: RunContext) -> Ran: ...


class FromSpec:
    """A target made of a spec: its name, expectation and description are the spec's."""

    spec: Any

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expect(self) -> tuple[Expectation, ...]:
        """The spec's expectation (the user's strings), read as kinds."""
        return expectations(self.spec.expect)

    @property
    def description(self) -> str:
        return self.spec.description
