"""Several nodes: one ``distcheck attach`` per node meets node 0's over distcheck's own store, the one
``distcheck run``'s multi-node mode uses (``launch.cluster.ClusterStore``, hosted by node 0 next to the
endpoint, under ``distcheck/<rdzv id>/attach``). Each node reads its own ranks and sends what it saw (its
``RankView``s) to node 0, which judges the whole job by the same rules and writes the report; the other nodes
wait for node 0's verdict and exit with its code. A node that never sends is named.

Only distcheck's own store is written: the job's rendezvous and its store are never touched."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distcheck.attach.flight import FrState
from distcheck.attach.judge import RankView
from distcheck.attach.position import Position
from distcheck.attach.read import ProcState
from distcheck.errors import LaunchError, UsageError
from distcheck.launch.cluster import ClusterStore, _put, _take, wait_for_keys
from distcheck.launch.node_config import NodeConfig, node_config
from distcheck.launch.slurm import slurm_job
from distcheck.launch.procs import Activity

DEFAULT_ID = "attach"


def attach_nodes(nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None, rdzv_id: str | None,
                 rdzv_timeout: float, store_port: int | None, env: Mapping[str, str]) -> NodeConfig:
    """Where this node's attach meets the others': ``run``'s flags and Slurm's variables (``node_config``), except
    the job's own ``MASTER_PORT``, which is the job's store and never attach's."""
    env = {k: v for k, v in env.items() if k != "MASTER_PORT"}
    if (nnodes or 1) > 1 and rdzv_endpoint is None and slurm_job(env) is None:
        raise UsageError("distcheck attach on several nodes needs --rdzv-endpoint HOST:PORT",
                         "give every node's attach the same one: node 0's host and a free port")
    return node_config(nnodes, node_rank, rdzv_endpoint, rdzv_id or DEFAULT_ID, "c10d", rdzv_timeout, None, None,
                       store_port, env=env)


VERDICT = "verdict"          # node 0's {"code": int, "summary": str, "run_dir": str}
READ_BY_S = 15.0             # how long node 0 keeps its store up for the other nodes to read the verdict


@dataclass(frozen=True)
class Gathered:
    views: dict[int, RankView]          # every rank any node read
    missing: tuple[int, ...] = ()       # nodes whose attach sent nothing in time


def view_to_dict(v: RankView) -> dict[str, Any]:
    return {"rank": v.rank, "pid": v.pid, "host": v.host, "node": v.node,
            "positions": [dataclasses.asdict(p) for p in v.positions],
            "activity": list(v.activity) if v.activity is not None else None,
            "state": dataclasses.asdict(v.state), "fr": v.fr.to_dict() if v.fr is not None else None}


def view_from_dict(d: Mapping[str, Any]) -> RankView:
    activity = Activity(*d["activity"]) if d.get("activity") is not None else None
    return RankView(int(d["rank"]), int(d["pid"]), tuple(Position(**p) for p in d["positions"]), activity,
                    ProcState(**d["state"]), host=str(d.get("host", "")), node=int(d.get("node", 0)),
                    fr=FrState.from_dict(d["fr"]) if d.get("fr") else None)


class Meeting:
    """This node's part in a multi-node attach, over node 0's store."""

    def __init__(self, config: NodeConfig, note=lambda text: None) -> None:
        from torch.distributed import PrefixStore

        self.config = config
        self.cluster = ClusterStore(config, note)   # node 0 hosts it; the others connect (up to --rdzv-timeout)
        self.store = PrefixStore(f"distcheck/{config.rdzv_id}/attach", self.cluster.store)

    @property
    def leader(self) -> bool:
        return self.config.node_rank == 0

    def send(self, views: Mapping[int, RankView]) -> None:
        """Another node: what it read of its ranks, for node 0."""
        _put(self.store, f"views/{self.config.node_rank}", json.dumps([view_to_dict(v) for v in views.values()]))

    def gather(self, local: Mapping[int, RankView], timeout_s: float) -> Gathered:
        """Node 0: every node's views as they come, up to ``timeout_s``; the nodes that sent none are missing."""
        views = dict(local)
        pending = set(range(1, self.config.nnodes))
        deadline = time.monotonic() + timeout_s
        while pending:
            came = {n for n in pending if self.store.check([f"views/{n}"])}
            for node in sorted(came):
                views.update({v.rank: v for v in map(view_from_dict, json.loads(_take(self.store, f"views/{node}")))})
            pending -= came
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.1 if came else 0.2)
        return Gathered(views, tuple(sorted(pending)))

    def post_verdict(self, code: int, summary: str, run_dir: str, readers: tuple[int, ...]) -> None:
        """Node 0: the verdict, then stay until the nodes that sent views have read it (the store ends with us)."""
        self.store.set(VERDICT, json.dumps({"code": code, "summary": summary, "run_dir": run_dir}))
        wait_for_keys(self.store, [f"read/{n}" for n in readers], READ_BY_S)

    def verdict(self, timeout_s: float) -> dict[str, Any]:
        """Another node: node 0's verdict."""
        if not wait_for_keys(self.store, [VERDICT], timeout_s):
            raise LaunchError(f"node 0's distcheck attach gave no verdict within {timeout_s:g} s",
                              "look at node 0's output: its report, if any, is in its run dir")
        said = json.loads(self.store.get(VERDICT))
        self.store.set(f"read/{self.config.node_rank}", "1")
        return said
