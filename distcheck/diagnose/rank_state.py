"""How a rank ended, from plain facts about it: the one classification that a
live launch (``collect``), a run dir read back (``from_traces``) and Flight
Recorder dumps (``from_dumps``) all use. Pure.
"""

from __future__ import annotations

from distcheck.models import EndReason, Event, Phase, RankState


def classify_rank(phase: str | None, waiting_in: Event | None, stack_top: str | None, error_where: str | None,
                  *, primary: bool, end_reason: str | None = None,
                  killed_by_us: bool = False) -> tuple[RankState, str | None]:
    """(state, where) of one rank.

    ``waiting_in`` is the collective it was in at the end, ``stack_top`` the user
    frame its stack dump shows, ``error_where`` where its exception was raised.
    ``primary``: its failure is a root cause, not a reaction to another rank's.
    ``end_reason`` is how the launch ended, None when read back from files that
    do not say; ``killed_by_us``: distcheck's own teardown ended it.
    """
    if primary:
        if phase == Phase.ERROR:
            return RankState.CRASHED, error_where or stack_top
        return RankState.CRASHED, waiting_in.callsite if waiting_in else stack_top
    if phase == Phase.FINISHED:
        return RankState.FINISHED, error_where   # set only where it left by sys.exit (rank.exit_site)
    if end_reason == EndReason.MAX_DURATION:   # cut at the end of the window, mid-work is normal
        return RankState.RUNNING, waiting_in.callsite if waiting_in else stack_top
    if waiting_in is not None:   # where the host is: in the call, or (NCCL) on at its line while the call waits
        return RankState.STUCK, (stack_top or waiting_in.callsite) if waiting_in.enqueued else waiting_in.callsite
    if end_reason == EndReason.COMPLETED:
        return RankState.FINISHED, None
    # Ended from outside: by distcheck's teardown while it was busy (or nobody says how), else by a peer's end.
    if end_reason is None or (killed_by_us and EndReason.of(end_reason).by_distcheck):
        return RankState.RUNNING, stack_top
    return RankState.KILLED, stack_top
