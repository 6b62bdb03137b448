"""The first phase of judging a run: what it left, read once into the facts every rule works from. Pure.

``rules.analyze`` runs three phases: facts (here) → findings (each rule a function of these facts alone,
``rules.find_all``) → causal linking (one pass that says which finding follows from which, ``causes.link``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distcheck.diagnose.common import RunFacts, Table, group_table
from distcheck.diagnose.unrecorded import with_unrecorded_calls
from distcheck.models import Event, RankOutcome, RankState


@dataclass(frozen=True)
class Facts:
    """What one run left: every rank's records and their calls matched by (group, seq), how each rank ended,
    how the launch ended (``run``), and what the scenario's ranks reported (``results``)."""

    traces: Mapping[int, Sequence[Event]]
    table: Table                              # {(group, members): {seq: {rank: event}}} (``common.group_table``)
    outcomes: Mapping[int, RankOutcome]       # with the C++-issued call a rank died in before its record had it
    run: RunFacts
    results: Mapping[int, Mapping[str, Any]]

    @property
    def finished(self) -> frozenset[int] | None:
        """The ranks that ended normally (None: no outcome is known, so every rank counts)."""
        if not self.outcomes:
            return None
        return frozenset(r for r, o in self.outcomes.items() if o.state == RankState.FINISHED)


def facts_of(traces: Mapping[int, Sequence[Event]], outcomes: Mapping[int, RankOutcome], run: RunFacts,
             results: Mapping[int, Mapping[str, Any]] | None = None) -> Facts:
    table = group_table(traces)
    return Facts(traces=traces, table=table, outcomes=with_unrecorded_calls(outcomes, table), run=run,
                 results=results or {})
