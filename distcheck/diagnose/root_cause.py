"""Which failure is the root cause, and which are reactions to it. Pure.

When one rank dies, its peers usually fail too ("Connection closed by peer", SIGTERM from the agent).
Those are consequences, not causes: only the first *primary* failure is reported as ``crashed``; the
others keep the state they were in (``stuck`` in the collective they were waiting in, or ``killed``).
``evidence.collect`` reads how each rank ended (its status, trace, exit and log) into a ``RankEnd``; this
module judges them, and ``diagnose.rank_state`` says each rank's state from the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from distcheck.diagnose.backend_error import watchdog_abort
from distcheck.diagnose.common import is_peer_failure
from distcheck.files.launch_dir import RankStatus
from distcheck.models import EndReason, Event, Phase

# Ends that cut ranks off mid-work: a rank the agent does not list as failed left by itself.
CUT_SHORT = (EndReason.CRASH, EndReason.CERTAIN_HANG, EndReason.STALL, EndReason.BUSY_TIMEOUT, EndReason.TIMEOUT,
             EndReason.MAX_DURATION)


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, as its files and the launcher say."""

    rank: int
    status: RankStatus
    events: Sequence[Event] = ()
    exit_code: int | None = None
    signal: str | None = None
    left_early: bool = False     # exited with code 0 in the middle of its work (os._exit(0)) while others ran
    abort: str | None = None     # the C++ exception a SIGABRT came from (gloo's own words), from its log

    @property
    def failed(self) -> bool:
        return (self.status.phase == Phase.ERROR or self.signal is not None or self.exit_code not in (None, 0)
                or self.left_early)


def primary_failures(ends: Sequence[RankEnd], killed_by_us: AbstractSet[int], node_lost: bool) -> frozenset[int]:
    """The root-cause candidates: failures that are not reactions to another failure."""
    failed = [f for f in ends if f.failed and f.rank not in killed_by_us
              and f.status.phase not in (Phase.INTERRUPTED, Phase.FINISHED)]
    # a peer's end made it fail; or NCCL's watchdog ended it (its time-out, an aborted communicator): a reaction
    reactions = [f for f in failed if (f.status.phase == Phase.ERROR and is_peer_failure(f.status.exception))
                 or watchdog_abort(f.abort) is not None]
    primary = [f for f in failed if f not in reactions and f.signal != "SIGTERM"]
    # A rank that vanished without a word (SIGTERM and SIGKILL leave none) beside one that said why it
    # failed was ended after it: the one with a word is the cause.
    worded = [f for f in primary if f.signal is not None or f.status.phase == Phase.ERROR
              or f.exit_code not in (None, 0)]
    # With no word from any: one that vanished inside a collective was waiting for one that vanished
    # outside (mp.spawn terminates the survivors after a rank dies): the latter is the cause.
    outside = [f for f in primary if not (f.events and f.events[-1].t_exit is None)]
    primary = worded or outside or primary
    if not primary and not reactions:
        primary = failed   # e.g. every rank was SIGTERMed from outside: report them as they are
    # Only reactions (a peer left, e.g. it finished and destroyed its process group): the traces tell
    # who never came to the collectives the reacting ranks failed in. One that failed outside any
    # collective (in init_process_group while its peers had already left, or waiting on the store for a
    # key no peer sets) is a failure of its own: nothing else explains it, and its exit status is the job's.
    # A lost node explains it (its ranks' ends went with it, and the run says so).
    if not primary and not node_lost:
        primary = [f for f in reactions if waiting_in(f.events) is None]
    return frozenset(f.rank for f in primary)


def another_failed_first(failures: Mapping[int, tuple[int | None, str | None]],
                         statuses: Mapping[int, RankStatus | None], records_lost: bool) -> bool:
    """Another rank failed on its own (a signal, or an error that is not a reaction to a peer's end).
    torch's launcher then stops the other ranks itself (seen on torch 2.6 and 2.9, not on 2.13): they are
    that failure's consequence, not ranks that left with code 0 by themselves. A node lost mid-run took
    its ranks' ends with it: the first failure may have been one of them (its peers then fail as reactions).
    ``failures``: rank -> (exit code, signal) of each rank the launcher lists as failed (asked for a rank not
    among them, so every one listed is another)."""
    if records_lost:
        return True
    for r, (exit_code, signal) in failures.items():
        if signal is not None:
            return True
        status = statuses.get(r)
        reaction = status is not None and status.phase == Phase.ERROR and is_peer_failure(status.exception)
        if exit_code not in (None, 0) and not reaction:
            return True
    return False


def left_early(listed_failed: bool, killed_by_us: bool, phase: str | None, end_reason: str | None,
               another_first: bool) -> bool:
    """The agent lists only failures: a rank it does not list, that distcheck did not kill and that never reached
    the end of its work, left by itself with code 0 (os._exit(0)) while others ran."""
    return (not listed_failed and not killed_by_us and phase in (Phase.STARTING, Phase.RUNNING)
            and end_reason in CUT_SHORT and not another_first)


def before_teardown(status: RankStatus, killed_by_us: bool, detected_at: float | None) -> RankStatus:
    """A rank that wrote "finished", or a failure, only after distcheck decided to end the run left through its own
    handling of the teardown (a test harness that catches the peer's "Connection closed" and exits, a SIGTERM
    handler that raises): a reaction to the teardown, not the end of its work. It was running when decided."""
    if (killed_by_us and detected_at is not None and status.phase in (Phase.FINISHED, Phase.ERROR)
            and status.t_update is not None and status.t_update >= detected_at):
        return dataclasses.replace(status, phase=Phase.RUNNING, exception=None, traceback=None, where=None)
    return status


def waiting_in(events: Sequence[Event]) -> Event | None:
    """The collective a rank was in at the end: still open, or the one that failed under it (an older call
    that failed and was survived is not where the rank is now)."""
    # an async call is waited on elsewhere; but on NCCL every call waits on the device until its work completes
    found = next((e for e in reversed(events) if (not e.async_op or e.t_returned is not None)
                  and (e.t_exit is None or e.error)), None)
    if found is not None and found.t_exit is not None and found is not events[-1]:
        return None
    return found
