"""Pure analysis: per-rank events + rank outcomes + scenario results → findings.

No I/O, no printing, no process groups. Each finding kind has its own module
(mismatch, order, hang, crash, count, numeric, duplicates, straggler); this
one runs them in order and says what was observed and whether that was expected.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from distcheck.diagnose.backend_error import find_backend_mismatches
from distcheck.diagnose.common import ABNORMAL_ENDS, RunFacts, agreeing, group_table, majority
from distcheck.diagnose.count import find_count_differences
from distcheck.diagnose.crash import find_command_failure, find_crashes
from distcheck.diagnose.duplicates import find_duplicates, find_partial_coverage
from distcheck.diagnose.metrics import find_metric_results
from distcheck.diagnose.hang import find_hangs, find_startup_hang, find_timeout
from distcheck.diagnose.mismatch import find_mismatches
from distcheck.diagnose.numeric import explain_numbers, find_numeric
from distcheck.diagnose.out_of_step import caused_by_out_of_step, find_out_of_step
from distcheck.diagnose.unrecorded import with_unrecorded_calls
from distcheck.diagnose.coverage import find_coverage_gaps
from distcheck.diagnose.windows import find_window_divergence, window_note
from distcheck.diagnose.straggler import find_late_arrivals, find_stragglers
from distcheck.diagnose.unwaited import find_unwaited_handles
from distcheck.models import Event, Finding, RankOutcome, RankState

__all__ = ["RunFacts", "analyze", "behaved_as_expected", "collectives_compared", "group_table", "majority",
           "observed_kinds"]


def analyze(
    traces: Mapping[int, Sequence[Event]],
    outcomes: Mapping[int, RankOutcome],
    facts: RunFacts,
    results: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Every finding for one run, most important first.

    A crash or hang that a mismatch explains comes after that mismatch: the
    mismatch is the root cause, the dead or stuck rank its consequence.
    """
    table = group_table(traces)
    outcomes = with_unrecorded_calls(outcomes, table)   # a C++-issued call a rank died in before its record had it
    mismatches = find_mismatches(table) + find_window_divergence(facts.elided)   # and before long traces' windows
    mismatches += find_backend_mismatches(outcomes, traces, mismatches)   # gloo's words, where fingerprints say nothing
    crashes = find_crashes(outcomes, facts, mismatches) or find_command_failure(facts)
    hangs = [] if crashes else find_hangs(table, outcomes, facts, mismatches)
    hangs = hangs or ([] if crashes else find_startup_hang(outcomes, facts))
    out_of_step = find_out_of_step(traces, hangs)   # the rank that broke its groups' pattern, before its cycle
    hangs = caused_by_out_of_step(hangs, out_of_step)
    mismatches += out_of_step
    counts = find_count_differences(table, facts, explained=bool(crashes or hangs or facts.end_reason in ABNORMAL_ENDS),
                                    outcomes=outcomes)
    timeout = find_timeout(outcomes, facts, crashes + hangs)
    results = results or {}
    duplicates = find_duplicates(results, facts.world_size, traces)
    numeric = explain_numbers(find_numeric(results), duplicates, [m for m in mismatches if m.kind == "order"])
    finished = frozenset(r for r, o in outcomes.items() if o.state == RankState.FINISHED) if outcomes else None
    numeric += find_metric_results(results, finished)   # torchmetrics vs their single-process replay
    stopped = crashes + hangs + timeout
    # the async call some ranks never waited on, where the ranks parted after it: the root cause, named first
    unwaited = find_unwaited_handles(traces, facts.waited, stopped + mismatches + counts)
    caused = [f for f in stopped if "caused_by" in f.data]
    first = [f for f in stopped if f not in caused]
    found = (unwaited + first + mismatches + caused + counts + numeric + duplicates + find_stragglers(table, facts) + find_late_arrivals(table, facts, outcomes)
            + find_coverage_gaps(outcomes) + find_partial_coverage(results) + window_note(facts.elided))
    return agreeing(found, outcomes)   # no second finding may say a rank was elsewhere


def collectives_compared(traces: Mapping[int, Sequence[Event]]) -> int:
    """How many (group, seq) calls were seen on at least two ranks and compared."""
    table = group_table(traces)
    return sum(1 for seqs in table.values() for events in seqs.values() if len(events) >= 2)


def observed_kinds(findings: Iterable[Finding]) -> tuple[str, ...]:
    """Kinds of the errors and warnings; a numeric warning (a metric check that could not run, a
    sync_on_compute=False metric whose ranks differ as asked) is shown, but is no wrong result."""
    kinds = sorted({f.kind for f in findings if f.severity == "error"
                    or (f.severity == "warning" and f.kind != "numeric")})
    return tuple(kinds) or ("pass",)


def behaved_as_expected(expected: Sequence[str], observed: Sequence[str]) -> bool:
    """'pass' must see no finding but a straggler; otherwise every expected kind must be observed.

    Extra kinds are allowed: a mismatch that makes gloo abort a rank also shows
    as a crash, a hang can leave ranks with different counts.
    """
    if tuple(expected) == ("pass",):
        # A late rank is a timing warning, not a wrong result: a run that waited for one still passes.
        # A coverage warning is distcheck's own shortcoming (records it lost), not the job's.
        return set(observed) <= {"pass", "straggler", "coverage"}
    return set(expected) <= set(observed)
