"""What distcheck could not watch on a rank, said once instead of staying silent. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from distcheck.models import CAP_HOOKS, HOOK_LOST, Finding, Hook, Kind, RankOutcome, Severity
from distcheck.text import rank_list


def find_backend_timeout(outcomes: Mapping[int, RankOutcome], stall_timeout_s: float | None) -> list[Finding]:
    """A warning where the job's own process-group timeout ends a hang before distcheck's stall timeout can (NCCL's
    watchdog aborts the process past it): distcheck names a certain hang at once, but an uncertain one only at
    --stall-timeout, and the backend may end the job first."""
    timeouts = {r: o.pg_timeout_s for r, o in outcomes.items() if o.pg_timeout_s}
    if not timeouts or stall_timeout_s is None or min(timeouts.values()) > stall_timeout_s + BACKEND_MARGIN_S:
        return []
    shortest = min(timeouts.values())
    ranks = tuple(sorted(r for r, t in timeouts.items() if t == shortest))
    return [Finding(kind=Kind.COVERAGE, severity=Severity.WARNING, odd_ranks=ranks, data={"pg_timeout_s": shortest},
                    summary=(f"The job's process-group timeout ({shortest:g} s, on {rank_list(ranks)}) is not well "
                             f"above --stall-timeout ({stall_timeout_s:g} s): the backend may end a hang (NCCL's "
                             f"watchdog aborts the process) before distcheck decides it. A certain hang is named at "
                             f"once; for the others, give init_process_group a timeout of at least "
                             f"{stall_timeout_s + BACKEND_MARGIN_S:g} s"
                             + (f", or lower --stall-timeout below {shortest - BACKEND_MARGIN_S:g} s."
                                if shortest > 2 * BACKEND_MARGIN_S else ".")))]


# What distcheck needs beyond --stall-timeout to decide a stall and take the evidence (the sidecar's sync grace).
BACKEND_MARGIN_S = 10.0


def find_coverage_gaps(outcomes: Mapping[int, RankOutcome]) -> list[Finding]:
    """An info finding per distinct reason a rank's C++-issued collectives went unwatched, and one per
    distcheck hook that failed inside the user's process (rule 0: caught there, reported here)."""
    by_reason: dict[str, list[int]] = {}
    for rank, o in sorted(outcomes.items()):
        if o.unwatched:
            by_reason.setdefault(o.unwatched, []).append(rank)
    found = [Finding(kind=Kind.COVERAGE, severity=Severity.INFO, odd_ranks=tuple(ranks),
                     summary=f"On {rank_list(ranks)}, {reason}.", data={"reason": reason})
             for reason, ranks in by_reason.items()]
    return found + find_hook_failures(outcomes)


def find_hook_failures(outcomes: Mapping[int, RankOutcome]) -> list[Finding]:
    """One info finding per failed hook: on which ranks, how often, the first error, what went unrecorded.
    The user's program was not affected (the hook caught its own error), so it is never a failure."""
    by_hook: dict[str, dict[int, dict]] = {}
    for rank, o in sorted(outcomes.items()):
        for hook, failure in (o.hook_failures or {}).items():
            by_hook.setdefault(hook, {})[rank] = failure
    found = []
    for hook, per_rank in by_hook.items():
        ranks = tuple(per_rank)
        count = sum(int(f.get("count", 1)) for f in per_rank.values())
        error = next(iter(per_rank.values())).get("error", "")
        try:
            lost = HOOK_LOST[Hook(hook)]
        except ValueError:   # a hook a newer distcheck named
            lost = "part of what it records was not recorded"
        if hook in {h.value for h in CAP_HOOKS}:
            found.append(_cap_note(hook, ranks, error.removeprefix("CapReached: "), lost))
            continue
        found.append(Finding(
            kind=Kind.COVERAGE, severity=Severity.INFO, odd_ranks=ranks,
            summary=(f"On {rank_list(list(ranks))}, distcheck's {hook} hook failed {count} time(s) ({error}): {lost}. "
                     "Your program was not affected: distcheck caught its own error."),
            data={"hook": hook, "count": count, "error": error, "lost": lost}))
    return found


def _cap_note(hook: str, ranks: tuple[int, ...], why: str, lost: str) -> Finding:
    """A recorder that reached its memory cap: a limit distcheck keeps on itself, not a failure."""
    recorder = hook.removesuffix("_cap")
    return Finding(
        kind=Kind.COVERAGE, severity=Severity.INFO, odd_ranks=ranks,
        summary=(f"On {rank_list(list(ranks))}, distcheck's {recorder} recorder reached its memory cap ({why}): "
                 f"{lost}. Your program was not affected: the cap bounds what distcheck keeps in its process."),
        data={"hook": hook, "capped": True, "error": why, "lost": lost})
