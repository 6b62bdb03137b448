"""How torch and the libraries on top of it issue the collectives a user never wrote. Pure knowledge,
shared by the tracer (how to number them) and the rules (how to pair and judge them); no torch import.

Measured on torch 2.13, gloo (tests/test_rules_ecosystem.py and tests/test_ecosystem_e2e.py check it):

* **P2P calls advance the group's collective counter** on gloo (one per ``send``/``recv``/``isend``/
  ``irecv``, one per op of a ``batch_isend_irecv``), but a rank's peers do not make the same P2P
  calls: a rank that sends to two peers counts two, each receiver one. gloo pairs collectives by
  their own tags, not by that counter, so the job stays correct while the counters drift apart. The
  collective numbering distcheck compares across ranks therefore leaves every P2P call out.
* **monitored_barrier on gloo is P2P with rank 0**: each other rank sends to rank 0 and waits for
  its answer (2 counter numbers); rank 0 receives from every other rank, then answers each
  (2 (N - 1) numbers). It is numbered as one call on every rank, so the calls after it keep the same
  numbers on all ranks. A rank inside it waits only for rank 0 (rank 0: for every other rank), and it
  ends with an error naming the ranks that did not arrive within its ``timeout``. Other backends do
  not implement it (NCCL raises).
* **DTensor's ``full_tensor()``** (and ``redistribute`` to ``Replicate``) is a functional
  ``all_gather_into_tensor`` issued from C++: no Python call of ``torch.distributed`` is made, so
  its record comes from the group counter and the Flight Recorder (``profiling_name``
  ``gloo:all_gather``), its line from the rank's stack.
* **DeviceMesh** dimensions are ordinary process groups, one per mesh dimension a rank belongs to.
"""

from __future__ import annotations

from typing import Mapping

from distcheck.models import Event

# Calls numbered apart from the group's collectives: how many numbers of the collective numbering each
# takes (its other counter numbers are the rank's own and are left out).
P2P_CALLS = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
NUMBERED_APART: Mapping[str, int] = {**{name: 0 for name in P2P_CALLS}, "monitored_barrier": 1}

MONITORED_BARRIER = "monitored_barrier"
MONITORED_ROOT = 0   # the group rank every other rank reports to


def monitored_barrier_counts(group_rank: int, group_size: int, backend: str = "gloo") -> int | None:
    """How far one monitored_barrier advances the group's collective counter on ``group_rank``
    (None: the backend has no monitored_barrier)."""
    if backend != "gloo":
        return None
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) if group_rank == MONITORED_ROOT else 2


def monitored_barrier_waits_for(group_rank: int, members: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks a rank inside a monitored_barrier (gloo) waits for: the root waits for every
    other member, every other member only for the root."""
    if not members:
        return ()
    root = members[MONITORED_ROOT]
    if members[group_rank] == root:
        return tuple(m for m in members if m != root)
    return (root,)


# Calls that only synchronise (no data): a rank in one of them, paired at one number with a peer
# that moves data, is not the same call with another field — one side is waiting somewhere else.
SYNC_ONLY = ("barrier", MONITORED_BARRIER)


def is_sync_only(op: str | None) -> bool:
    return op in SYNC_ONLY


def waits_elsewhere(events: Mapping[int, Event]) -> tuple[dict[int, Event], dict[int, Event]] | None:
    """(ranks in a sync-only call, ranks in a call that moves data) at one (group, seq), when both are
    there and the call did not complete on every rank: the ranks took different paths and each side
    waits in its own call (accelerate's ``wait_for_everyone`` on one rank while DDP's forward broadcast
    waits on the other). That is a hang at two lines, not a tie mismatch. Where one side is a majority, the
    mismatch already names the ranks out of step, and stays the finding."""
    sync = {r: e for r, e in events.items() if is_sync_only(e.op)}
    if not sync or len(sync) == len(events) or all(e.completed for e in events.values()):
        return None
    if 2 * len(sync) != len(events):
        return None   # one side is a majority: the mismatch names the odd ranks (DDP's extra step vs a barrier)
    return sync, {r: e for r, e in events.items() if r not in sync}
