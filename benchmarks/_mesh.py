"""A training job's collectives on a 3-D mesh, as a model (a helper of ``cluster_scale``, not part of distcheck).

The mesh is ``init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))``: a rank's coordinates
are ``(rank // (pp * tp), rank // tp % pp, rank % tp)``, so with ``tp`` ranks per node a TP group is one node,
a pipeline's stages are consecutive nodes and DP runs across the pipelines. Its groups are named as torch's
DeviceMesh names them (a counter in creation order: the world is ``"0"``, then every DP group, every PP group,
every TP group, each dimension's groups in row-major order of the other coordinates; ``_mesh_traces`` checks
the names against a real DeviceMesh).

One training step of pipeline stage ``s`` (``step_ops``), as FSDP2 + tensor parallel + 1F1B issue it:

* per micro-batch forward: receive the activation from stage ``s-1`` (not on stage 0); per layer, FSDP's
  all-gather of the layer's shard (DP group) and TP's all-reduce (TP group); send the activation to ``s+1``
  (not on the last stage);
* per micro-batch backward, in 1F1B order (``pp - s - 1`` warm-up forwards, then one forward and one
  backward, then the cool-down backwards): receive the gradient from ``s+1``, per layer (last first) the
  all-gather and the TP all-reduce, and on the last micro-batch FSDP's reduce-scatter of the gradients
  (DP group); send the gradient to ``s-1``;
* the optimizer's all-reduce of the gradient norm (world), and every ``eval_every`` steps and at the end an
  evaluation barrier (world).

So a stage's call count differs from its neighbours' (the first and last stages have half the P2P calls).
``standstill`` runs a step's calls rank by rank with the backends' pairing (a collective completes when every
member entered it, a send is eager, a receive completes when its send was posted) until nothing can move:
where every rank waits when a fault is planted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

DIMS = ("dp", "pp", "tp")
SYNTHETIC_FILE = "/synthetic/train.py"
# The line of the synthetic training script each kind of call comes from: (line, function).
LINES = {
    "fsdp_all_gather": (120, "unshard"),
    "tp_all_reduce": (140, "row_parallel"),
    "fsdp_reduce_scatter": (160, "reduce_grads"),
    "recv_forward": (205, "recv_forward"),
    "send_forward": (210, "send_forward"),
    "recv_backward": (230, "recv_backward"),
    "send_backward": (235, "send_backward"),
    "grad_norm": (300, "clip_grad_norm"),
    "step_all_reduce": (380, "step"),        # the flat job's one call per step
    "eval_barrier": (412, "evaluate"),
}


class Op(NamedTuple):
    """One call of a step: its torch function, the group (a mesh dimension, ``world``, or ``next``/``prev``: the
    pipeline peer of a send or receive) and the kind (a key of ``LINES``)."""

    fn: str
    group: str
    kind: str


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int
    tp: int

    @classmethod
    def parse(cls, text: str | None, world: int) -> "Mesh":
        """``"tp=8,pp=4"`` (dp is the rest of the world); None or ``flat``: one world group, every rank its own
        (dp = world)."""
        sizes = {"tp": 1, "pp": 1}
        if text and text != "flat":
            for item in text.split(","):
                name, _, value = item.partition("=")
                if name.strip() not in sizes:
                    raise SystemExit(f"--mesh: {name!r} is not tp or pp (dp is the rest of the world)")
                sizes[name.strip()] = int(value)
        inner = sizes["tp"] * sizes["pp"]
        if world % inner:
            raise SystemExit(f"--mesh {text}: {world} ranks are not a whole number of tp x pp = {inner}")
        return cls(world // inner, sizes["pp"], sizes["tp"])

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def flat(self) -> bool:
        return self.pp == 1 and self.tp == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def rank(self, d: int, s: int, t: int) -> int:
        return (d % self.dp) * self.pp * self.tp + (s % self.pp) * self.tp + t % self.tp

    def stage(self, rank: int) -> int:
        return self.coords(rank)[1]

    def members(self, dim: str, rank: int) -> tuple[int, ...]:
        if dim == "world":
            return tuple(range(self.world))
        d, s, t = self.coords(rank)
        if dim == "dp":
            return tuple(self.rank(x, s, t) for x in range(self.dp))
        if dim == "pp":
            return tuple(self.rank(d, x, t) for x in range(self.pp))
        return tuple(self.rank(d, s, x) for x in range(self.tp))

    def group_name(self, dim: str, rank: int) -> str:
        """The name torch gives the group of ``dim`` that holds ``rank`` (``"0"``: the world)."""
        if dim == "world":
            return "0"
        d, s, t = self.coords(rank)
        offsets = {"dp": 0, "pp": self.pp * self.tp, "tp": self.pp * self.tp + self.dp * self.tp}
        index = {"dp": s * self.tp + t, "pp": d * self.tp + t, "tp": d * self.pp + s}
        return str(1 + offsets[dim] + index[dim])

    def peer(self, rank: int, group: str) -> int:
        """The pipeline peer of a send or receive: the same DP and TP coordinates, the next or previous stage."""
        d, s, t = self.coords(rank)
        return self.rank(d, s + (1 if group == "next" else -1), t)

    def moved(self, rep: int, rank: int, x: int) -> int:
        """Rank ``x`` as ``rank`` sees what ``rep`` (of the same stage) sees as ``x``: shifted by their DP and TP
        distance (the pipeline peer of ``rep`` becomes the pipeline peer of ``rank``)."""
        (d0, _, t0), (d1, _, t1), (dx, sx, tx) = self.coords(rep), self.coords(rank), self.coords(x)
        return self.rank(dx + d1 - d0, sx, tx + t1 - t0)


@dataclass(frozen=True)
class Model:
    """The step's shape: layers per stage, micro-batches, how often the evaluation barrier comes."""

    layers: int = 4
    micro_batches: int = 8
    eval_every: int = 10

    def step_ops(self, mesh: Mesh, stage: int, evaluate: bool = False, skip: int | None = None) -> list[Op]:
        """One step of ``stage``; ``evaluate``: it ends with the evaluation barrier (every ``eval_every`` steps
        and the job's last); ``skip``: a micro-batch this stage leaves out (a planted fault: it neither receives, computes nor sends
        it, so every later send and receive of its pipeline pairs one off)."""
        if mesh.flat:
            ops = [Op("all_reduce", "world", "step_all_reduce")]
        else:
            ops = self._pipeline(mesh, stage, [m for m in range(self.micro_batches) if m != skip])
            ops.append(Op("all_reduce", "world", "grad_norm"))
        if evaluate:
            ops.append(Op("barrier", "world", "eval_barrier"))
        return ops

    def _pipeline(self, mesh: Mesh, stage: int, batches: list[int]) -> list[Op]:
        warmup = min(mesh.pp - stage - 1, len(batches))
        order = [("F", m) for m in batches[:warmup]]
        for i, m in enumerate(batches[warmup:]):
            order += [("F", m), ("B", batches[i])]
        order += [("B", m) for m in batches[len(batches) - warmup:]]
        ops: list[Op] = []
        for phase, m in order:
            ops += self._forward(mesh, stage) if phase == "F" else self._backward(mesh, stage, m == batches[-1])
        return ops

    def _forward(self, mesh: Mesh, stage: int) -> list[Op]:
        ops = [Op("recv", "prev", "recv_forward")] if stage > 0 else []
        for _ in range(self.layers):
            ops += [Op("all_gather_into_tensor", "dp", "fsdp_all_gather"), Op("all_reduce", "tp", "tp_all_reduce")]
        return ops + ([Op("send", "next", "send_forward")] if stage < mesh.pp - 1 else [])

    def _backward(self, mesh: Mesh, stage: int, reduce: bool) -> list[Op]:
        ops = [Op("recv", "next", "recv_backward")] if stage < mesh.pp - 1 else []
        for _ in range(self.layers):
            ops += [Op("all_gather_into_tensor", "dp", "fsdp_all_gather"), Op("all_reduce", "tp", "tp_all_reduce")]
            if reduce:
                ops.append(Op("reduce_scatter_tensor", "dp", "fsdp_reduce_scatter"))
        return ops + ([Op("send", "prev", "send_backward")] if stage > 0 else [])

    def steps_for(self, mesh: Mesh, calls: int) -> int:
        """Steps that give stage 0 about ``calls`` calls (at least 2: the healthy ones and the last)."""
        per_step = len(self.step_ops(mesh, 0)) + (1.0 / self.eval_every if self.eval_every else 0.0)
        return max(2, round(calls / per_step))


def standstill(mesh: Mesh, ops: Mapping[int, list[Op]], stop_at: Mapping[int, int] | None = None,
               stalled: Iterable[tuple[str, int]] = ()) -> dict[int, int]:
    """Where each rank stands when nothing can move: the index of the call it waits in (``len(ops[r])``: it
    completed all of them). ``stop_at``: ranks that go no further than that index (a lost node, a rank
    computing); ``stalled``: (group name, occurrence in this step) of collectives that never complete even once
    every member entered them (a TP group stuck in its all-reduce)."""
    stop_at = stop_at or {}
    slots = ("dp", "tp", "world", "next", "prev")
    plans: dict[int, tuple[list[int], list[int], list[bool]]] = {}   # id(op list) -> per call: slot, occurrence, send
    for calls in ops.values():
        if id(calls) not in plans:
            seen: dict[tuple[int, bool], int] = defaultdict(int)
            kinds = [(slots.index(op.group), op.fn == "send") for op in calls]
            occurrence = []
            for kind in kinds:
                occurrence.append(seen[kind])
                seen[kind] += 1
            plans[id(calls)] = ([k for k, _ in kinds], occurrence, [send for _, send in kinds])
    wide = 1 << 20   # keys: (group or pair) * wide + occurrence
    stuck = {int(name) * wide + k for name, k in stalled}
    sizes = (mesh.dp, mesh.tp, mesh.world)
    pos = dict.fromkeys(ops, 0)
    entered: dict[int, list[int]] = defaultdict(list)
    sent: set[int] = set()
    receiving: dict[int, int] = {}
    todo = list(ops)
    while todo:
        r = todo.pop()
        kinds, occurrence, sends = plans[id(ops[r])]
        limit = min(len(kinds), stop_at.get(r, len(kinds)))
        ids = (int(mesh.group_name("dp", r)), int(mesh.group_name("tp", r)), 0)
        while pos[r] < limit:
            i = pos[r]
            kind = kinds[i]
            if kind >= 3:   # a send or receive with the pipeline's next or previous stage
                peer = mesh.peer(r, slots[kind])
                key = ((r * mesh.world + peer) if sends[i] else (peer * mesh.world + r)) * wide + occurrence[i]
                if sends[i]:
                    sent.add(key)
                    waiter = receiving.pop(key, None)
                    if waiter is not None:
                        pos[waiter] += 1
                        todo.append(waiter)
                elif key not in sent:
                    receiving[key] = r
                    break
                pos[r] += 1
                continue
            key = ids[kind] * wide + occurrence[i]
            waiting = entered[key]
            waiting.append(r)
            if len(waiting) < sizes[kind] or key in stuck:
                break
            del entered[key]
            for m in waiting:
                if m != r:
                    pos[m] += 1
                    todo.append(m)
            pos[r] += 1
    return pos
