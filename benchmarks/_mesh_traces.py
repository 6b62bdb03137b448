"""The simulated ranks' traces of a 3-D mesh job, written by distcheck's real tracer (a helper of
``cluster_scale``, not part of distcheck).

One representative rank of each pipeline stage (DP and TP coordinate 0) is traced for real: a process group of
torch's ``fake`` backend (every collective returns at once) of the job's world size, the real DeviceMesh on it,
distcheck's ``Tracer`` wrapping torch's own functions, called from the lines of a synthetic training script
(``_mesh.LINES``). The groups' names and members in the trace are the ones the tracer read from that mesh.

Every other rank of the stage issues the same calls in the same order on its own groups, so its trace is the
representative's with its definitions rewritten (``Template.chunk``): the G records (a group's name and
members; a P2P pair's ranks) and the peers of sends and receives, moved by the rank's DP and TP distance from
the representative. The E and X records, between the definitions, are copied. ``tests/test_cluster.py``
checks a small mesh's derived traces against the real tracer run as every rank.

The healthy steps are written before the job starts; the last step's records are written when a fault is
planted, up to where ``_mesh.standstill`` says each rank stands (``Template.cut``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _mesh import DIMS, LINES, SYNTHETIC_FILE, Mesh, Model, Op

TAG_E, TAG_X = 1, 2


def _source() -> str:
    """The synthetic script: each kind's call on its own line, inside a function of the kind's name."""
    lines = [""] * (max(line for line, _ in LINES.values()) + 2)
    for line, function in LINES.values():
        lines[line - 2] = f"def {function}(call, *args, **kwargs):"
        lines[line - 1] = "    return call(*args, **kwargs)"
    return "\n".join(lines) + "\n"


def schedule(mesh: Mesh, model: Model, steps: int, stage: int, skip: int | None = None) -> list[list[Op]]:
    """Every step's calls of ``stage``; the last step leaves out micro-batch ``skip``."""
    every = model.eval_every or steps   # 0: only at the end
    return [model.step_ops(mesh, stage, evaluate=s == steps - 1 or (s + 1) % every == 0,
                           skip=skip if s == steps - 1 else None) for s in range(steps)]


def trace_rank(mesh: Mesh, steps: list[list[Op]], rank: int, path: Path) -> None:
    """``rank``'s trace of ``steps``, by the real tracer over a fake process group and the real DeviceMesh."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distcheck.rank.tracer import Tracer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.world)
    try:
        groups: dict[str, Any] = {"world": None}
        if not mesh.flat:
            from torch.distributed.device_mesh import init_device_mesh

            device_mesh = init_device_mesh("cpu", (mesh.dp, mesh.pp, mesh.tp), mesh_dim_names=DIMS)
            for dim in ("dp", "tp"):
                groups[dim] = device_mesh.get_group(dim)
                got = (c10d._world.pg_names[groups[dim]], tuple(c10d.get_process_group_ranks(groups[dim])))
                if got != (mesh.group_name(dim, rank), mesh.members(dim, rank)):   # the model names groups as torch does
                    raise SystemExit(f"rank {rank}'s {dim} group is {got}, the model says "
                                     f"{(mesh.group_name(dim, rank), mesh.members(dim, rank))}")
        tracer = Tracer(path, rank)
        code: dict[str, Any] = {}
        exec(compile(_source(), SYNTHETIC_FILE, "exec"), code)
        calls = {fn: tracer.wrap(fn, getattr(dist, fn)) for fn in
                 ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv", "barrier")}
        small, wide = torch.ones(64), torch.ones(64 * mesh.dp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # torch 2.13 names all_gather_single and the like
            for step in steps:
                for op in step:
                    _issue(code[LINES[op.kind][1]], calls[op.fn], op, groups, mesh, rank, small, wide)
        tracer.close()
    finally:
        dist.destroy_process_group()


def _issue(site: Any, call: Any, op: Op, groups: dict[str, Any], mesh: Mesh, rank: int, small: Any, wide: Any
           ) -> None:
    if op.fn == "all_gather_into_tensor":
        site(call, wide, small, group=groups[op.group])
    elif op.fn == "reduce_scatter_tensor":
        site(call, small, wide, group=groups[op.group])
    elif op.fn == "all_reduce":
        site(call, small, group=groups[op.group])
    elif op.fn == "barrier":
        site(call, group=groups[op.group])
    elif op.fn == "send":
        site(call, small, dst=mesh.peer(rank, op.group))
    else:
        site(call, small, src=mesh.peer(rank, op.group))


def write_templates(mesh: Mesh, model: Model, calls: int, skip: tuple[int, int] | None, out: Path) -> dict[str, Any]:
    """A template per stage (``stage{s}``), and for a stage that skips a micro-batch in its last step
    (``skip``: (stage, micro-batch)) a second one (``stage{s}.skip``): the trace bytes and their index."""
    steps = model.steps_for(mesh, calls)
    out.mkdir(parents=True, exist_ok=True)
    names = {}
    for stage in range(mesh.pp):
        variants = [(f"stage{stage}", None)] + ([(f"stage{stage}.skip", skip[1])] if skip and skip[0] == stage else [])
        for name, skipped in variants:
            plan = schedule(mesh, model, steps, stage, skipped)
            tmp = Path(tempfile.mkdtemp(prefix="distcheck-mesh-tpl-"))
            trace_rank(mesh, plan, mesh.rank(0, stage, 0), tmp / "rank.trace")
            data = (tmp / "rank.trace").read_bytes()
            shutil.rmtree(tmp, ignore_errors=True)
            index = _index(data, sum(len(s) for s in plan[:-1]), plan[-1])
            (out / f"{name}.trace").write_bytes(data)
            (out / f"{name}.json").write_text(json.dumps(index))
            names[name] = len(data)
    return {"steps": steps, "templates": names}


def _index(data: bytes, last_step_from: int, last_ops: list[Op]) -> dict[str, Any]:
    """Where each call's records start (its definitions first), where its E record ends, where the trace ends;
    the text records (their byte range and lines); the last step's calls."""
    from distcheck.files.trace import SLOT, TAG_T, slot_words, text_at

    n = len(data) // SLOT
    words = slot_words(data, n)
    starts, enters, texts = [], [], []
    start, i = 3 * SLOT, 3           # after the version and sync records
    while i < n:
        tag = words[4 * i] & 0xFF
        if tag == TAG_T:
            text, j = text_at(words, i, n)
            texts.append([i * SLOT, j * SLOT, text.text()])
            i = j
            continue
        if tag == TAG_E:
            starts.append(start)
            enters.append((i + 1) * SLOT)
        elif tag == TAG_X:
            start = (i + 1) * SLOT
        i += 1
    return {"call_start": starts, "enter_end": enters, "end": n * SLOT, "texts": texts,
            "last_step_from": last_step_from, "last_ops": [list(op) for op in last_ops]}


@dataclass
class Template:
    """One stage's trace as its representative wrote it, and how to make another rank's from it."""

    mesh: Mesh
    rep: int
    data: bytes
    index: dict[str, Any]

    @classmethod
    def load(cls, folder: Path, name: str, mesh: Mesh, stage: int) -> "Template":
        return cls(mesh, mesh.rank(0, stage, 0), (folder / f"{name}.trace").read_bytes(),
                   json.loads((folder / f"{name}.json").read_text()))

    @property
    def last_ops(self) -> list[Op]:
        return [Op(*op) for op in self.index["last_ops"]]

    def healthy(self, rank: int) -> bytes:
        """``rank``'s trace up to its last step: every healthy step."""
        return self.chunk(rank, 0, self.cut(-1))

    def cut(self, at: int, entered: bool = False) -> int:
        """The byte offset before the last step's call ``at`` (-1: the last step's start), or after its E record
        (``entered``: the rank is inside it); ``at`` past the last call: the end of the trace."""
        first = self.index["last_step_from"]
        if at < 0:
            return self.index["call_start"][first]
        if first + at >= len(self.index["call_start"]):
            return self.index["end"]
        return self.index["enter_end" if entered else "call_start"][first + at]

    def chunk(self, rank: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of the template as ``rank`` writes them: its own groups and peers."""
        if rank == self.rep:
            return self.data[start:end]
        from distcheck.files.trace import text_slots

        parts, at = [], start
        for a, b, text in self.index["texts"]:
            if b <= start or a >= end:
                continue
            parts += [self.data[at:a], text_slots("".join(self._line(rank, line) for line in
                                                          text.splitlines(keepends=True)).encode())]
            at = b
        parts.append(self.data[at:end])
        return b"".join(parts)

    def _line(self, rank: int, line: str) -> str:
        from distcheck.files.trace import encode_members

        fields = line.rstrip("\n").split("\t")
        mesh = self.mesh
        if fields[0] == "G" and fields[2].startswith("p2p:"):
            src, dst = (mesh.moved(self.rep, rank, int(x)) for x in fields[2][4:].split(">"))
            fields[2], fields[3] = f"p2p:{src}>{dst}", f"{src},{dst}"
        elif fields[0] == "G" and fields[2] != "0":
            dim = next(d for d in ("dp", "tp") if mesh.group_name(d, self.rep) == fields[2])
            fields[2], fields[3] = mesh.group_name(dim, rank), encode_members(mesh.members(dim, rank))
        elif fields[0] == "F" and fields[2] in ("send", "recv"):
            fields[7] = str(mesh.moved(self.rep, rank, int(fields[7])))
        return "\t".join(fields) + "\n"


def restamped(records: bytes, t_ns: int) -> bytes:
    """``records`` with every E and X record's time set to ``t_ns`` (a step written now, not when the template
    was traced)."""
    from distcheck.files.trace import CHECK, SLOT

    words = array("Q")
    words.frombytes(records)
    n = len(records) // SLOT
    for i in range(n):
        if words[4 * i] & 0xFF in (TAG_E, TAG_X):
            words[4 * i + 2] = t_ns
            words[4 * i + 3] = words[4 * i] ^ words[4 * i + 1] ^ t_ns ^ CHECK
    return words.tobytes()
