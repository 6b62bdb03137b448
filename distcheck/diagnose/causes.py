"""The last phase of judging a run: causal linking. Pure.

Every rule found what it found from the facts alone (``rules.find_all``); this one pass says which finding
follows from which, and so what is shown, and in what order:

* a gloo size abort that a fingerprint mismatch in the same call already explains is that mismatch;
* a crash inside a call with a mismatch is that mismatch's consequence (``crash.because_of``), and so is a crash
  outside every call of a rank that returned from a call whose sizes differed (``crash.after_a_mismatch``);
* a crash explains the hangs, the time-out and the count differences it leaves behind: they are not said;
* a hang in a call with a mismatch is that mismatch's consequence (``hang.because_of``); a cycle of waits
  through a rank out of step with its groups is that rank's (``out_of_step``);
* a wrong number next to duplicated samples or crossed calls is named with them as its likely reason;
* an async call some ranks never waited on is the root cause of an error after it (``unwaited``).

A finding that follows from another carries it as ``Finding.caused_by`` and is shown after its cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from distcheck.diagnose import crash, hang
from distcheck.diagnose.common import agreeing
from distcheck.diagnose.facts import Facts
from distcheck.diagnose.numeric import explain_numbers
from distcheck.diagnose.out_of_step import caused_by_out_of_step, find_out_of_step
from distcheck.diagnose.unwaited import find_unwaited_handles
from distcheck.models import Finding, Kind


@dataclass(frozen=True)
class Found:
    """What each rule found, from the facts alone (``rules.find_all``): nothing here is linked yet."""

    mismatches: list[Finding] = field(default_factory=list)   # fingerprints, call by call; long traces' windows
    backend: list[Finding] = field(default_factory=list)      # gloo's size aborts, as mismatches
    crashes: list[Finding] = field(default_factory=list)      # the root-cause crash (or the command's failure)
    hangs: list[Finding] = field(default_factory=list)        # calls left open when the run was cut
    startup: list[Finding] = field(default_factory=list)      # ranks that never got past start-up
    timeout: list[Finding] = field(default_factory=list)      # what --timeout left open
    counts: list[Finding] = field(default_factory=list)       # different numbers of calls in a run that ended
    numeric: list[Finding] = field(default_factory=list)      # results that differ from their reference
    metrics: list[Finding] = field(default_factory=list)      # torchmetrics against their single-process replay
    duplicates: list[Finding] = field(default_factory=list)   # samples drawn or fed twice, or never
    notes: list[Finding] = field(default_factory=list)        # stragglers, coverage: shown last, as they are


def link(found: Found, facts: Facts) -> list[Finding]:
    """Every finding of the run, linked to its cause, most important first: a cause before what follows from
    it; no finding that tells another story of where a rank was than the first one (``common.agreeing``)."""
    outcomes, run = facts.outcomes, facts.run
    mismatches = found.mismatches + unexplained(found.backend, found.mismatches)
    crashes = [crash.after_a_mismatch(crash.because_of(c, mismatches, outcomes, run), mismatches, outcomes,
                                      facts.traces) for c in found.crashes]
    hangs = [] if crashes else [hang.because_of(h, mismatches) for h in found.hangs] or found.startup
    # the rank that broke its groups' pattern, when a cycle of waits goes through it: the cycle's cause
    out_of_step = find_out_of_step(facts.traces, hangs)
    hangs = caused_by_out_of_step(hangs, out_of_step)
    mismatches = mismatches + out_of_step
    stopped = crashes + hangs + ([] if crashes or hangs else found.timeout)
    counts = [] if crashes or hangs else found.counts
    numeric = explain_numbers(found.numeric, found.duplicates, [m for m in mismatches if m.kind is Kind.ORDER])
    # the async call some ranks never waited on, where the ranks parted after it: the root cause, named first
    unwaited = find_unwaited_handles(facts.traces, run.waited, stopped + mismatches + counts)
    first = [f for f in stopped if f.caused_by is None]
    caused = [f for f in stopped if f.caused_by is not None]
    return agreeing(unwaited + first + mismatches + caused + counts + numeric + found.metrics + found.duplicates
                    + found.notes, outcomes)


def unexplained(backend: Sequence[Finding], mismatches: Sequence[Finding]) -> list[Finding]:
    """The backend's size aborts that no fingerprint mismatch in the same call already explains."""
    known = {(f.group, f.seq) for f in mismatches if f.kind is Kind.MISMATCH}
    return [f for f in backend if f.group is None or (f.group, f.seq) not in known]
