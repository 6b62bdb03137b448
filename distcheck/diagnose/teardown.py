"""The verdict rests on what was seen when it was decided. Pure.

Once distcheck decides (a certain hang, a stall, a time-out, Ctrl-C), it ends the job: stacks first, then SIGTERM.
What the job does from then on is a reaction to that teardown, not evidence: a SIGTERM handler that saves a
checkpoint or agrees to stop (Lightning's under Slurm issues a ``broadcast``), a call that completes because a
peer's handler paired with it. So the records are cut at the decision: a call entered after it is left out of the
verdict, and told apart in a note; a call that was open at the decision is open in the verdict, whenever it
completed afterwards. The same in every path: ``run``, a wrapped ``torchrun`` or ``srun`` (whose ranks Slurm may
signal itself), the pytest plugin, node 0 of a multi-node job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from distcheck.models import Event, Finding, Kind, Severity
from distcheck.text import rank_list, site


def split_at_decision(events: Sequence[Event], decided_at: float | None) -> tuple[list[Event], list[Event]]:
    """(the events as they stood when distcheck decided, the calls entered after it). ``decided_at``: None when
    distcheck decided nothing (the job ended by itself): everything stands."""
    if decided_at is None:
        return list(events), []
    kept, after = [], []
    for e in events:
        if e.t_enter > decided_at:
            after.append(e)
        elif e.t_exit is not None and e.t_exit > decided_at and not e.error:
            kept.append(e._replace(t_exit=None))   # open when it was decided: it waited there
        else:
            kept.append(e)
    return kept, after


def _place(e: Event) -> str:
    """Where a teardown call was issued: the user's line, else the library's (a handler runs in no frame of the
    user's), else nothing: a call with no place is not "at an unknown place"."""
    where = e.callsite or e.library_callsite
    return f" at {site(where)}" if where else (f" from {e.label}" if e.label else "")


def teardown_note(after: Mapping[int, Sequence[Event]]) -> list[Finding]:
    """One info note for the calls the ranks entered after distcheck decided (its teardown's reactions)."""
    if not any(after.values()):
        return []
    said: dict[str, list[int]] = defaultdict(list)
    for rank, events in sorted(after.items()):
        for e in events[:3]:
            said[f"{e.op} #{e.seq} (group {e.group}){_place(e)}"].append(rank)
    calls = "; ".join(f"{rank_list(ranks)} issued {call}" for call, ranks in said.items())
    ranks = tuple(sorted(r for r, events in after.items() if events))
    return [Finding(kind=Kind.COVERAGE, severity=Severity.INFO, odd_ranks=ranks, data={"after_decision": True},
                    summary=(f"After distcheck decided, during its teardown, {calls}: the job's own reaction to being "
                             f"stopped (a SIGTERM handler saving or agreeing to stop), not part of the verdict."))]
