"""A simulated node's ranks: their trace and status files (a helper of ``cluster_scale``, not part of distcheck).

A rank is not a process here: it is the files distcheck's watchdog reads (its trace, as the tracer leaves it,
and its status), and its pid is an idle process that stands for the node's ranks. The healthy steps are
written before the job starts; at the fault's onset each rank's last step is written up to where it stands
(``_faults.Plan``), its E and X records stamped with the time they are written, then its sync record (what the
sidecar writes while the rank waits); a straggler's sync record carries a new stack digest every
``STACK_EVERY_S`` (its stack moves: it computes), and when it catches up every rank writes the rest of the step
and says it finished.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from _faults import Plan, last_ops
from _mesh import LINES, SYNTHETIC_FILE, Mesh, Model
from _mesh_traces import Template, restamped

STACK_EVERY_S = 0.2


class NodeRanks:
    """The ranks of one simulated node."""

    def __init__(self, files: Any, node: int, ranks: range, mesh: Mesh, model: Model,
                 templates: dict[str, Template], plan: Plan, pid: int) -> None:
        self.files, self.node, self.ranks, self.mesh, self.model = files, node, ranks, mesh, model
        self.templates, self.plan, self.pid = templates, plan, pid
        self._used: dict[int, int] = {}
        self._stack = 0

    def template(self, rank: int) -> Template:
        stage = self.mesh.stage(rank)
        return self.templates[f"stage{stage}.skip" if rank in self.plan.skipping else f"stage{stage}"]

    def write_healthy(self) -> None:
        from distcheck.files.launch_dir import RankStatus
        from distcheck.models import Phase

        self.files.make()
        for rank in self.ranks:
            data = self.template(rank).healthy(rank)
            with open(self.files.trace(rank), "wb") as f:
                f.write(data)
                f.truncate(len(data) + max(65536, len(data) // 4))   # the preallocated end: zeros (a hole here)
            self._used[rank] = len(data)
            self.files.write_status(rank, RankStatus(rank=rank, pid=self.pid, host="sim", node=self.node,
                                                     t_start=time.time(), phase=Phase.RUNNING,
                                                     t_update=time.time(), pg_initialized=True))

    def plant(self, onset: float) -> None:
        """The onset: every rank but a straggler's writes its last step up to where it stands, its records stamped
        with the onset (``time.time()``) whenever this node's turn to write them comes: a worker writes its nodes
        one after another, and stamps of the moment of writing made the last nodes of each worker late by up to
        1 s, a straggler of every group at every row."""
        for rank in self.ranks:
            if self.plan.straggler and rank in self.plan.ranks:
                continue
            at, entered = self.plan.where(rank)
            tpl = self.template(rank)
            self._append(rank, tpl.chunk(rank, tpl.cut(-1), tpl.cut(at, entered)), int(onset * 1e9))
            if rank in self.plan.finished:
                self._set_phase(rank, "FINISHED")

    def stack_moved(self) -> None:
        """A straggler's ranks compute: the sidecar's sync record says their stack moved."""
        from distcheck.files.trace import SYNC_OFFSET, sync_slot

        self._stack += 1
        for rank in self.plan.ranks:
            if rank in self.ranks:
                with open(self.files.trace(rank), "r+b") as f:
                    f.seek(SYNC_OFFSET)
                    f.write(sync_slot(time.time_ns(), 0x5EED0000 + self._stack, False))

    def resume(self, caught_up: float) -> None:
        """The straggler caught up (at ``caught_up``): every rank writes the rest of its last step and finishes."""
        for rank in self.ranks:
            tpl = self.template(rank)
            at, entered = self.plan.where(rank)
            if self.plan.straggler and rank in self.plan.ranks:
                at, entered = -1, False
            self._append(rank, tpl.chunk(rank, tpl.cut(at, entered), tpl.index["end"]), int(caught_up * 1e9))
            self._set_phase(rank, "FINISHED")

    def where(self, rank: int) -> tuple[str | None, str]:
        """(the callsite of the call the rank is in, torch's function), for its stack probe."""
        at, entered = self.plan.where(rank)
        ops = last_ops(self.mesh, self.model, self.plan, rank)
        if not entered or at >= len(ops):
            return None, ""
        line, function = LINES[ops[at].kind]
        return f"{SYNTHETIC_FILE}:{line}:{function}", ops[at].fn

    def _append(self, rank: int, records: bytes, t_ns: int) -> None:
        from distcheck.files.trace import SYNC_OFFSET, sync_slot

        with open(self.files.trace(rank), "r+b") as f:
            f.seek(self._used[rank])
            f.write(restamped(records, t_ns))
            f.seek(SYNC_OFFSET)
            f.write(sync_slot(time.time_ns(), 0, False))   # the sidecar's: every record so far is in the file
        self._used[rank] += len(records)

    def _set_phase(self, rank: int, phase: str) -> None:
        from distcheck.models import Phase

        status = self.files.read_status(rank)
        self.files.write_status(rank, dataclasses.replace(status, phase=Phase[phase], t_update=time.time()))


def spare_fds() -> None:
    """Room for every simulated node's store connections (two each) in one process."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
