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
  When gloo aborts the rank inside it (a peer's ``all_gather`` of another size met it), the sidecar
  has often not recorded it yet: the rank's stack at the abort (faulthandler) still shows DTensor's
  frames above ``_functional_collectives.wait_tensor``, and the call is the group's next number.
* **DeviceMesh** dimensions are ordinary process groups, one per mesh dimension a rank belongs to.
  The groups of one dimension are translates of each other ((2, 2) mesh: "dp" is [0, 2] and [1, 3],
  "tp" is [0, 1] and [2, 3]), so a group's *pattern* (its members less its lowest) names the
  dimension on every rank alike: the same program on every rank calls the same patterns in the
  same order.
* **On the wire**, gloo runs ``all_gather``, ``all_gather_into_tensor`` and a functional
  all_gather as one algorithm: calls that differ only in that name pair with each other, and gloo
  aborts the receiver when their sizes differ. Calls of different algorithms never pair (they wait).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distcheck.models import Event

# Calls numbered apart from the group's collectives: how many numbers of the collective numbering each
# takes (its other counter numbers are the rank's own and are left out).
P2P_CALLS = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
NUMBERED_APART: Mapping[str, int] = {**{name: 0 for name in P2P_CALLS}, "monitored_barrier": 1}

MONITORED_BARRIER = "monitored_barrier"


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


# -- functional collectives issued from C++ --------------------------------------

FUNCTIONAL_FILE = "/torch/distributed/_functional_collectives.py"
# DTensor's redistribution issues its functional collective and waits on it lazily, in its own frames (a gloo
# abort can find the thread unpadding the result the wait is still inside): as good as a funcol frame.
REDISTRIBUTE_FILE = "/torch/distributed/tensor/_redistribute.py"


@dataclass(frozen=True)
class FunctionalCall:
    """A collective a torch API issued from C++: what the user called, and the collective it runs
    (None: it depends on what the stack does not show, such as a DTensor's placements)."""

    api: str
    op: str | None


# (file fragment, function) of the torch frame the user called → that API; outermost match wins.
FUNCTIONAL_APIS: tuple[tuple[str, str, FunctionalCall], ...] = (
    ("/torch/distributed/tensor/_api.py", "full_tensor", FunctionalCall("DTensor.full_tensor()", "all_gather")),
    ("/torch/distributed/tensor/_api.py", "redistribute", FunctionalCall("DTensor.redistribute()", None)),
    ("/torch/distributed/tensor/_api.py", "distribute_tensor", FunctionalCall("distribute_tensor()", None)),
    (FUNCTIONAL_FILE, "all_gather_tensor", FunctionalCall("funcol.all_gather_tensor()", "all_gather")),
    (FUNCTIONAL_FILE, "all_reduce", FunctionalCall("funcol.all_reduce()", "all_reduce")),
    (FUNCTIONAL_FILE, "reduce_scatter_tensor",
     FunctionalCall("funcol.reduce_scatter_tensor()", "reduce_scatter_tensor")),
    (FUNCTIONAL_FILE, "all_to_all_single", FunctionalCall("funcol.all_to_all_single()", "all_to_all_single")),
    (FUNCTIONAL_FILE, "broadcast", FunctionalCall("funcol.broadcast()", "broadcast")),
)


def functional_call_in(frames: Sequence[tuple[str, int, str]]) -> FunctionalCall | None:
    """The functional collective a thread is inside, from its stack (innermost first: (file, line,
    function)): a frame of ``_functional_collectives`` (issuing or waiting on it) or of DTensor's
    ``redistribute_local_tensor``, named by the
    outermost torch API above it that the user called. None when no functional collective is there."""
    if not any(FUNCTIONAL_FILE in file or (REDISTRIBUTE_FILE in file and fn == "redistribute_local_tensor")
               for file, _, fn in frames):
        return None
    for file, _, fn in reversed(frames):   # outermost first: the API the user called
        for fragment, name, found in FUNCTIONAL_APIS:
            if fragment in file and fn == name:
                return found
    return FunctionalCall("a functional collective", None)


# One algorithm on the wire (gloo), whatever the call's name.
WIRE_OPS: Mapping[str, str] = {"all_gather_into_tensor": "all_gather",
                               "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


def wire_op(op: str | None) -> str | None:
    return WIRE_OPS.get(op, op) if op else op


# -- DeviceMesh ------------------------------------------------------------------


def group_pattern(members: Sequence[int]) -> tuple[int, ...]:
    """A group's members less its lowest: the same for every group of one mesh dimension."""
    if not members:
        return ()
    low = min(members)
    return tuple(sorted(m - low for m in members))
