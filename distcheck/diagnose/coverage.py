"""What distcheck could not watch on a rank, said once instead of staying silent. Pure."""

from __future__ import annotations

from typing import Mapping

from distcheck.models import CAP_HOOKS, HOOK_LOST, Finding, Hook, RankOutcome
from distcheck.text import rank_list


def find_coverage_gaps(outcomes: Mapping[int, RankOutcome]) -> list[Finding]:
    """An info finding per distinct reason a rank's C++-issued collectives went unwatched, and one per
    distcheck hook that failed inside the user's process (rule 0: caught there, reported here)."""
    by_reason: dict[str, list[int]] = {}
    for rank, o in sorted(outcomes.items()):
        if o.unwatched:
            by_reason.setdefault(o.unwatched, []).append(rank)
    found = [Finding(kind="coverage", severity="info", odd_ranks=tuple(ranks),
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
            kind="coverage", severity="info", odd_ranks=ranks,
            summary=(f"On {rank_list(list(ranks))}, distcheck's {hook} hook failed {count} time(s) ({error}): {lost}. "
                     "Your program was not affected: distcheck caught its own error."),
            data={"hook": hook, "count": count, "error": error, "lost": lost}))
    return found


def _cap_note(hook: str, ranks: tuple[int, ...], why: str, lost: str) -> Finding:
    """A recorder that reached its memory cap: a limit distcheck keeps on itself, not a failure."""
    recorder = hook.removesuffix("_cap")
    return Finding(
        kind="coverage", severity="info", odd_ranks=ranks,
        summary=(f"On {rank_list(list(ranks))}, distcheck's {recorder} recorder reached its memory cap ({why}): "
                 f"{lost}. Your program was not affected: the cap bounds what distcheck keeps in its process."),
        data={"hook": hook, "capped": True, "error": why, "lost": lost})
