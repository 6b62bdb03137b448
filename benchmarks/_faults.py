"""The faults ``cluster_scale`` plants, one per run, and what node 0's verdict must say of each (a helper of
``cluster_scale``, not part of distcheck).

Each fault is planted in the job's last step. ``plan`` says where every rank then stands (``_mesh.standstill``
with the fault in place: the index of the last step's call it waits in, whether it entered it) and what else
happens at the onset; ``named`` reads node 0's verdict:

* ``barrier_absent``: one rank of the last node finishes instead of entering the world's evaluation barrier;
  every other rank waits in it. A certain hang: the verdict names the absent rank and the barrier's line.
* ``tp_group_stall``: the last node's TP group (its 8 ranks) stalls inside its third all-reduce of the step
  (every member entered it; it never completes); every other rank runs on until it waits on them, in a DP
  all-gather or a pipeline receive. Not certain (the call might still complete): decided after
  ``--stall-timeout``. The verdict's first finding must be that TP group's all-reduce, not the waits downstream.
* ``pp_skip_microbatch``: stage 1 of the last pipeline (a node's 8 ranks) leaves out one micro-batch, so every
  later send and receive between it and its neighbours pairs one off, and its neighbours wait for a transfer
  that never comes. A certain hang: the verdict's first finding is a pipeline transfer (a send/receive pair, or a
  cycle of them) of that stage's ranks.
* ``node_lost``: the last node's distcheck (and its ranks) go away mid-step: its worker process is killed at
  the onset, its heartbeat stops. Node 0 finds it silent after ``SILENT_AFTER_S`` and its ranks dead: a certain
  hang decided on the lost ranks' death, the node counted lost (its ranks' records went with it), and the first
  finding a group whose members wait on one of its ranks, that rank "not known".
* ``straggler_node``: the last node's ranks are late (computing, their stacks moving) for ``--straggle-s``
  while every other rank waits on them, then they catch up and the job completes. No hang may be claimed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _mesh import LINES, SYNTHETIC_FILE, Mesh, Model, Op, standstill

FAULTS = ("barrier_absent", "tp_group_stall", "pp_skip_microbatch", "node_lost", "straggler_node")
ABSENT_LOCAL_RANK = 3     # of the last node: the rank that finishes instead of entering the barrier
STALLED_OCCURRENCE = 2    # the TP group's third all-reduce of the step
# node_lost: a stall timeout past the 10 s a node must be silent before node 0 counts it lost, so that the loss,
# not the stall, ends the run (at distcheck's defaults, 10 s each, the stall can come first)
LOST_NODE_STALL_TIMEOUT_S = 30.0


@dataclass
class Plan:
    """Where every rank stands after the fault, and what the onset does besides."""

    fault: str
    node: int                                   # the node it is planted on
    ranks: list[int]                            # the ranks it is planted on
    stand: list[int]                            # rank -> 2 * (index of the last step's call it is at) + entered
    finished: list[int] = field(default_factory=list)      # ranks that say they finished at the onset
    skipping: list[int] = field(default_factory=list)      # ranks whose last step leaves out a micro-batch
    group: str | None = None                    # the stalled group (tp_group_stall)
    line: int | None = None                     # the line the verdict must name

    def where(self, rank: int) -> tuple[int, bool]:
        return self.stand[rank] // 2, bool(self.stand[rank] % 2)

    @property
    def lost_node(self) -> int | None:
        return self.node if self.fault == "node_lost" else None

    @property
    def straggler(self) -> bool:
        return self.fault == "straggler_node"


def plan(fault: str, mesh: Mesh, model: Model, rpn: int) -> Plan:
    if fault not in FAULTS:
        raise SystemExit(f"--fault {fault}: not one of {', '.join(FAULTS)}")
    nodes = mesh.world // rpn
    node = nodes - 1
    if fault == "pp_skip_microbatch":
        if mesh.pp < 2:
            raise SystemExit("--fault pp_skip_microbatch needs a pipeline: --mesh pp=2 or more")
        node = mesh.rank(mesh.dp - 1, min(1, mesh.pp - 2), 0) // rpn
    ranks = list(range(node * rpn, (node + 1) * rpn))
    out = Plan(fault, node, ranks, [])
    shared = {s: model.step_ops(mesh, s, evaluate=True) for s in range(mesh.pp)}
    ops = {r: shared[mesh.stage(r)] for r in range(mesh.world)}
    stop_at: dict[int, int] = {}
    stalled: list[tuple[str, int]] = []
    if fault == "barrier_absent":
        absent = ranks[min(ABSENT_LOCAL_RANK, rpn - 1)]
        out.ranks, out.finished, out.line = [absent], [absent], LINES["eval_barrier"][0]
        stop_at[absent] = len(ops[absent]) - 1
    elif fault == "tp_group_stall":
        if mesh.tp < 2:
            raise SystemExit("--fault tp_group_stall needs tensor parallelism: --mesh tp=2 or more")
        out.ranks = list(mesh.members("tp", ranks[0]))
        out.group, out.line = mesh.group_name("tp", ranks[0]), LINES["tp_all_reduce"][0]
        stalled.append((out.group, STALLED_OCCURRENCE))
    elif fault == "pp_skip_microbatch":
        skipped = {s: model.step_ops(mesh, s, evaluate=True, skip=model.micro_batches // 2) for s in range(mesh.pp)}
        out.skipping = ranks
        ops.update({r: skipped[mesh.stage(r)] for r in ranks})
    elif fault == "node_lost":
        stop_at.update({r: len(ops[r]) // 2 for r in ranks})
    else:   # straggler_node: still computing before the step's first call
        stop_at.update(dict.fromkeys(ranks, 0))
    pos = standstill(mesh, ops, stop_at, stalled)
    # entered: a rank that stands at a call it reached by itself (not one stopped before it)
    out.stand = [2 * pos[r] + int(pos[r] < len(ops[r]) and r not in stop_at) for r in range(mesh.world)]
    return out


def last_ops(mesh: Mesh, model: Model, plan_: Plan, rank: int) -> list[Op]:
    return model.step_ops(mesh, mesh.stage(rank), evaluate=True,
                          skip=model.micro_batches // 2 if rank in plan_.skipping else None)


def named(plan_: Plan, result: Any, decision: str, evidence: str | None, lost: list[int]) -> tuple[bool, str]:
    """Whether node 0's verdict names the planted fault as this module's docstring says it must, and its first
    hang finding in words."""
    hangs = [f for f in result.findings if f.kind == "hang"]
    first = hangs[0] if hangs else None
    said = first.summary[:400] if first else "no hang finding"
    at = f"{SYNTHETIC_FILE}:{plan_.line}:" if plan_.line else None
    if plan_.fault == "straggler_node":   # node 0 never ended the job: it ran to its end
        return not hangs and decision == "continue", said
    if first is None:
        return False, said
    if plan_.fault == "barrier_absent":
        return any(plan_.ranks[0] in f.absent_ranks and f"{f.callsite}:".startswith(at) for f in hangs), said
    if plan_.fault == "tp_group_stall":
        return (first.group == plan_.group and sorted(first.waiting_ranks) == plan_.ranks
                and f"{first.callsite}:".startswith(at) and decision == "stall"), said
    if plan_.fault == "pp_skip_microbatch":   # a certain hang whose first finding is a pipeline transfer of the stage
        involved = set(first.waiting_ranks) | set(first.absent_ranks) | {
            r for part in first.data.get("cycle", ()) for r in part.get("ranks", ())}
        pipeline = (first.group or "").startswith("p2p:") or any(
            (part.get("group") or "").startswith("p2p:") for part in first.data.get("cycle", ()))
        return decision == "deadlock" and bool(involved & set(plan_.ranks)) and pipeline, said
    # node_lost: node 0 counted the node lost, decided on its ranks' death, and its first finding is a group that
    # waits on one of them, "not known" (its records went with the node)
    return lost == [plan_.node] and decision == "deadlock" and any(
        f"rank {r} " in f"{evidence} " for r in plan_.ranks) and bool(set(first.absent_ranks) & set(plan_.ranks)), said
