"""Pure analysis: per-rank events + rank outcomes + scenario results → findings.

No I/O, no printing, no process groups. Each finding kind has its own module
(mismatch, order, hang, crash, count, numeric, duplicates, straggler); this
one runs them in phases (facts → findings → causal linking: ``facts``, ``find_all``,
``causes``) and says what was observed and whether that was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distcheck.diagnose.apart import without_apart
from distcheck.diagnose.backend_error import find_backend_mismatches
from distcheck.diagnose.causes import Found, link
from distcheck.diagnose.common import RunFacts, Table, group_table, majority
from distcheck.diagnose.count import find_count_differences
from distcheck.diagnose.coverage import find_backend_timeout, find_coverage_gaps
from distcheck.diagnose.crash import find_command_failure, find_crashes
from distcheck.diagnose.duplicates import find_duplicates, find_partial_coverage
from distcheck.diagnose.facts import Facts, facts_of
from distcheck.diagnose.hang import find_hangs, find_startup_hang, find_timeout
from distcheck.diagnose.metrics import find_metric_results
from distcheck.diagnose.mismatch import find_mismatches
from distcheck.diagnose.numeric import find_numeric
from distcheck.diagnose.straggler import find_late_arrivals, find_stragglers
from distcheck.diagnose.teardown import teardown_note
from distcheck.diagnose.windows import find_window_divergence, window_note
from distcheck.models import PASS, Event, Expectation, Finding, Kind, RankOutcome, Severity

__all__ = ["RunFacts", "analyze", "behaved_as_expected", "collectives_compared", "group_table", "judge", "majority",
           "observed_kinds"]


def analyze(
    traces: Mapping[int, Sequence[Event]],
    outcomes: Mapping[int, RankOutcome],
    facts: RunFacts,
    results: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Every finding for one run, most important first, in three phases: the facts the run left, read once
    (``facts``); each rule's findings from those facts alone (``find_all``); one pass that links each finding
    to the one it follows from (``causes``): a crash or hang that a mismatch explains comes after that
    mismatch, the root cause."""
    return judge(facts_of(traces, outcomes, facts, results))


def judge(seen: Facts) -> list[Finding]:
    """``analyze`` on facts read already (``facts_of``), whose table the verdict also counts."""
    return link(find_all(seen), seen)


def find_all(facts: Facts) -> Found:
    """Every rule on the run's facts; no rule sees another's findings."""
    run, table, outcomes, traces, results = facts.run, facts.table, facts.outcomes, facts.traces, facts.results
    return Found(
        # read from outside, ranks at different calls hold nothing to compare (diagnose.apart)
        mismatches=find_mismatches(without_apart(table) if run.unnumbered else table)
        + find_window_divergence(run.elided),   # and before long traces' windows
        backend=find_backend_mismatches(outcomes, traces),   # gloo's words, where fingerprints say nothing
        crashes=find_crashes(outcomes, run) or find_command_failure(run),
        hangs=find_hangs(table, outcomes, run),
        startup=find_startup_hang(outcomes, run),
        timeout=find_timeout(outcomes, run),
        counts=find_count_differences(table, run, outcomes=outcomes),
        numeric=find_numeric(results),
        metrics=find_metric_results(results, facts.finished, run.metric_reference),   # vs their single-process replay
        duplicates=find_duplicates(results, run.world_size, traces),
        notes=(find_stragglers(table, run) + find_late_arrivals(table, run, outcomes) + find_coverage_gaps(outcomes)
               + find_backend_timeout(outcomes, run.stall_timeout_s) + find_partial_coverage(results)
               + window_note(run.elided) + teardown_note(run.after_decision)),
    )


def collectives_compared(table: Table) -> int:
    """How many (group, seq) calls of a run's table (``Facts.table``) were seen on at least two ranks and
    compared."""
    return sum(1 for seqs in table.values() for events in seqs.values() if len(events) >= 2)


def observed_kinds(findings: Iterable[Finding]) -> tuple[Expectation, ...]:
    """Kinds of the errors and warnings; a numeric warning (a metric check that could not run, a
    sync_on_compute=False metric whose ranks differ as asked) is shown, but is no wrong result."""
    kinds = sorted({f.kind for f in findings if f.severity is Severity.ERROR
                    or (f.severity is Severity.WARNING and f.kind is not Kind.NUMERIC)})
    return tuple(kinds) or (PASS,)


def behaved_as_expected(expected: Sequence[str], observed: Sequence[str]) -> bool:
    """'pass' must see no finding but a straggler; otherwise every expected kind must be observed.

    Extra kinds are allowed: a mismatch that makes gloo abort a rank also shows
    as a crash, a hang can leave ranks with different counts.
    """
    if tuple(expected) == (PASS,):
        # A late rank is a timing warning, not a wrong result: a run that waited for one still passes.
        # A coverage warning is distcheck's own shortcoming (records it lost), not the job's.
        return set(observed) <= {PASS, Kind.STRAGGLER, Kind.COVERAGE}
    return set(expected) <= set(observed)
