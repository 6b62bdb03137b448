"""Cluster scale: node 0's real code judging N simulated nodes over a real c10d TCPStore on loopback.

Each row is one job, one fault planted in it, and its own processes: node 0 (``_node0``: distcheck's store,
watchdog, channel, gather, diagnosis and every report format, so its peak RSS is its own) and worker processes
that run the other N-1 nodes (``_cluster_sim``: each node distcheck's real node-side code with its own store
connections: heartbeat, a watchdog that publishes its ranks and follows node 0's decision, its teardown on a
thread of its own, upload, result).

The job (``_mesh``): without ``--mesh``, the most uniform one possible: every rank all-reduces on the world
group, the same calls as every other. With ``--mesh tp=8,pp=4`` (dp is the rest of the world), a training step
on a 3-D DeviceMesh: FSDP all-gathers and reduce-scatters per layer on the DP group, TP all-reduces, 1F1B sends
and receives between pipeline stages, an optimizer all-reduce on the world, an evaluation barrier every
``--eval-every`` steps and at the end. Every rank's trace is written by distcheck's real tracer over a process
group of torch's fake backend and a real DeviceMesh (``_mesh_traces``), ``--records-per-rank`` records long.

The faults (``_faults``, one per row; ``--fault a,b`` runs each): ``barrier_absent`` (one rank finished while
the others wait in the world's barrier: the default), ``tp_group_stall``, ``pp_skip_microbatch``, ``node_lost``,
``straggler_node``. Each row says whether node 0's verdict named it (``planted_named``) and how long it took.

    python benchmarks/cluster_scale.py --nodes 8,64,512 --ranks-per-node 8 --records-per-rank 10000
    python benchmarks/cluster_scale.py --mesh tp=8,pp=4 --nodes 2048 --ranks-per-node 8 --records-per-rank 4000 \\
        --node-poll-s 1 --workers 16 --fault tp_group_stall,barrier_absent --json out.json   # 23 minutes a row here
    python benchmarks/cluster_scale.py --tiny     # 4 nodes of 2 ranks on a tp=2,pp=2 mesh, the TP group's stall
    python benchmarks/cluster_scale.py --tiny --fault barrier_absent,node_lost,straggler_node
    python benchmarks/cluster_scale.py --tiny --fault pp_skip_microbatch --mesh tp=2,pp=4 --nodes 8

Figures: ``hang_named_after_onset_s`` (node 0's decision minus the moment the last rank's record of the fault
landed; for ``tp_group_stall`` it includes ``--stall-timeout``, for ``node_lost`` the 10 s a node must be silent),
``named_after_last_publish_s`` (node 0's own share: from the last simulated node's first publish after the onset
to the verdict), ``named_after_last_change_s`` (from the last publish before the verdict, the one that completed
what node 0 judged by: a node's ranks may reach their waits over more than one publish),
``node0_peak_rss_mib``, ``report_after_decision_s`` (``gather_s``: every node's upload, ``judge_s``, ``reports_s``),
``report_after_last_upload_s`` (node 0's own share of the report: from the last node's upload to the files written;
the simulated nodes' teardowns share this host's cores, where a cluster's run at once on machines of their own),
``gather_s_per_node``, the report files' sizes, the terminal report's lines, the timeline's time in a headless
Chromium (where one is installed). ``--profile DIR`` writes node 0's polls, judgement and report writing as pstats.

What is not simulated: a real network (loopback only), NCCL or gloo, real ranks' CPU, torch's agent and its
rendezvous, and a machine per node (all nodes share this machine's CPUs; ``--node-poll-s`` is the simulated
nodes' poll interval, 0.1 s on a real node). With 2 cores or more node 0 runs on a core of its own
(``--node0-core``, the default): the simulated nodes' workers on the others, but for their teardowns and uploads
after node 0's decision, which take every core (each node's own machine on a cluster); node 0's store thread
shares its one core with its judgement, where a cluster's node 0 has more.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import conditions, free_port, parse_args, table, well_formed  # noqa: E402
from _faults import FAULTS, plan  # noqa: E402
from _mesh import Mesh, Model  # noqa: E402

# --tiny: node 0 and three simulated nodes in one worker, 2 ranks each, on a tp=2,pp=2 mesh, the TP group's stall:
# the same code and judgment, one row (each row is three processes that import torch: ~8 s of CPU on this 2-core
# machine). --fault names the others; tests/test_benchmarks.py runs them in the e2e lane (a lost node waits out
# 10 s of silence). No browser: opening the timeline is measured at scale, not here.
TINY = {"nodes": "4", "ranks_per_node": 2, "records_per_rank": 400, "workers": 1, "settle_s": 0.5,
        "mesh": "tp=2,pp=2", "fault": "tp_group_stall", "stall_timeout": 1.0, "straggle_s": 2.0, "browser": False}
# The gather's time per simulated node (the decision to the last node's bundle in, over the nodes), checked in the
# small configuration: a node's teardown and upload take 0.08-0.11 s per node there (load 8 on 2 cores). At 512 nodes
# the gather once took 205 s (0.4 s per node): the simulated nodes' teardowns ran one after another, each waiting its
# 1.5 s for stacks its ranks could not give. A pause of that kind in a node's teardown or upload, even on the nodes'
# own threads at once, is past this bound at 3 nodes (1.5 s / 3).
GATHER_PER_NODE_BOUND_S = 0.4
FIGURES = ("hang_named_after_onset_s", "node0_peak_rss_mib", "report_after_decision_s", "report_after_last_upload_s",
           "poll_s_median", "store_bytes_total", "upload_bytes_per_node", "gather_s", "gather_s_per_node", "judge_s",
           "reports_s")
COLUMNS = ["nodes", "ranks", "fault", "hang_named_after_onset_s", "last_node_published_after_onset_s",
           "named_after_last_publish_s", "named_after_last_change_s", "named_after_due_s", "node0_peak_rss_mib", "report_after_decision_s",
           "report_after_last_upload_s", "gather_s_per_node",
           "largest_report_file_mb", "terminal_lines", "poll_s_median", "store_bytes_total", "planted_named"]


def cores(node0: bool) -> set[int]:
    """``--node0-core``: node 0's process (its store, watchdog, judgment and reports) on the first of this
    process's cores, the simulated nodes' workers on the rest, but for their teardowns and uploads after node 0's
    decision (on every core: ``_cluster_sim.on_cores``). On a cluster node 0 has a machine of its own; here the
    2,047 simulated nodes' polls, teardowns and uploads shared the cores with it (load 40-76), and node 0's share
    of the decision and its report were timed at a tenth of a core."""
    mine = sorted(os.sched_getaffinity(0))
    return {mine[0]} if node0 else set(mine[1:])


def prepare(args: argparse.Namespace, root: Path, nodes: int, fault: str) -> Mesh:
    """The row's job in ``root``: its templates (the real tracer), its fault's plan, the mesh and model."""
    from _mesh_traces import write_templates

    mesh = Mesh.parse(args.mesh, nodes * args.ranks_per_node)
    model = Model(layers=args.layers, micro_batches=args.micro_batches,
                  eval_every=args.eval_every if args.eval_every is not None else (0 if mesh.flat else 10))
    planned = plan(fault, mesh, model, args.ranks_per_node)
    skip = (mesh.stage(planned.skipping[0]), model.micro_batches // 2) if planned.skipping else None
    written = write_templates(mesh, model, args.records_per_rank // 2, skip, root / "tpl")
    (root / "job.json").write_text(json.dumps({"mesh": asdict(mesh), "model": asdict(model), **written}))
    (root / "plan.json").write_text(json.dumps(asdict(planned)))
    return mesh


def run_row(args: argparse.Namespace, nodes: int, fault: str) -> dict[str, Any]:
    """Node 0 and the workers of simulated nodes as sibling processes (node 0's teardown ends its own
    descendants, as it does in a real run), around a store of the benchmark's own for its timing keys."""
    import datetime

    from torch.distributed import TCPStore

    from _node0 import worker_chunks

    root = Path(tempfile.mkdtemp(prefix=f"distcheck-cluster-{nodes}-", dir=args.workdir))
    began = time.time()
    mesh = prepare(args, root, nodes, fault)
    prepared = time.time() - began
    lost = json.loads((root / "plan.json").read_text())["node"] if fault == "node_lost" else None
    bench_port, port = free_port(), free_port()
    bench = TCPStore("127.0.0.1", bench_port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=900))
    common = ["--nnodes", str(nodes), "--port", str(port), "--bench-port", str(bench_port), "--root", str(root)]
    common += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
               if k in ("ranks_per_node", "node_poll_s", "workers", "settle_s", "stall_timeout", "straggle_s")]
    common += ["--profile", str(Path(args.profile).resolve())] if args.profile else []
    common += [] if args.browser else ["--no-browser"]
    common += ["--node0-core" if args.node0_core else "--no-node0-core"]
    out = root / "row.json"
    cmds = [[sys.executable, __file__, "--row", "--row-json", str(out), *common]]
    cmds += [[sys.executable, __file__, "--worker", "--first", str(c[0]), "--last", str(c[-1]), *common]
             for c in worker_chunks(nodes, args.workers, lost)]
    procs = [subprocess.Popen(c, start_new_session=True) for c in cmds]
    try:
        procs[0].wait(timeout=args.row_timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    del bench
    row = {"nodes": nodes, "ranks": mesh.world, "fault": fault, "mesh": asdict(mesh), "prepare_s": round(prepared, 1),
           "stall_timeout": args.stall_timeout}
    try:
        row |= json.loads(out.read_text())
    except (OSError, ValueError):
        row["error"] = f"exit {[p.returncode for p in procs]}"
        try:   # what node 0 said at its decision, before it was cut short
            row |= json.loads(Path(f"{out}.decision").read_text())
        except (OSError, ValueError):
            pass
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return _derived(row)


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    since = row.get("named_after_last_change_s", row.get("named_after_last_publish_s"))
    if row["fault"] == "tp_group_stall" and since is not None:
        # the stall's verdict may come only once every rank was still for --stall-timeout: node 0's own share is
        # what it took past that (the last publish before the verdict is the last change node 0 saw)
        row["named_after_due_s"] = round(since - row["stall_timeout"], 3)
    if "gather_s" in row:
        row["gather_s_per_node"] = round(row["gather_s"] / max(1, row["nodes"] - 1), 3)
        row["largest_report_file_mb"] = round(max(row["report_files_bytes"].values()) / 1e6, 2)
    uploaded = (row.get("nodes_uploaded_after_decision_s") or {}).get("100")
    if "report_after_decision_s" in row and uploaded is not None:
        # node 0's own share of the report: from the last node's upload (the simulated nodes tear down on this
        # host's cores, one after another; on a cluster each on its own machine, at once) to the files written
        row["report_after_last_upload_s"] = round(row["report_after_decision_s"] - max(0.0, uploaded), 2)
    return row


def _checks(rows: list[dict[str, Any]]) -> dict[str, bool]:
    found = {}
    for r in rows:
        name = f"{r['nodes']} nodes, {r['fault']}"
        found[f"{name}: the planted fault named as it must be, no node's error"] = \
            r.get("planted_named") is True and not r.get("errors")
        if "gather_s_per_node" in r and r["nodes"] <= 8 and r["fault"] != "node_lost":   # it waits out a silence
            found[f"{name}: the gather took at most {GATHER_PER_NODE_BOUND_S} s per node "
                  f"({r['gather_s_per_node']} s)"] = r["gather_s_per_node"] <= GATHER_PER_NODE_BOUND_S
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,64,512")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--records-per-rank", type=int, default=10_000)
    p.add_argument("--mesh", default=None, help="tp=T,pp=P (dp is the rest of the world); none: the flat job")
    p.add_argument("--fault", default="barrier_absent", help=f"one or more of {', '.join(FAULTS)}, one row each")
    p.add_argument("--layers", type=int, default=4, help="layers per pipeline stage")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluation barriers (10; flat: end only)")
    p.add_argument("--stall-timeout", type=float, default=5.0, help="distcheck's --stall-timeout (tp_group_stall)")
    p.add_argument("--straggle-s", type=float, default=3.0, help="how long the straggler node is late")
    p.add_argument("--workers", type=int, default=4, help="processes the simulated nodes are spread over")
    p.add_argument("--node-poll-s", type=float, default=0.1, help="the simulated nodes' watchdog poll interval")
    p.add_argument("--settle-s", type=float, default=3.0, help="healthy polling before the fault is planted")
    p.add_argument("--json", type=Path)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the launch dirs and reports")
    p.add_argument("--row-timeout", type=float, default=1800.0, help="seconds a row's node 0 may take, all told")
    p.add_argument("--profile", default=None, help="write node 0's judgment and report writing as pstats in this dir")
    p.add_argument("--node0-core", action=argparse.BooleanOptionalAction, default=None,
                   help="node 0 on a core of its own, the simulated nodes on the others (on by default with 2 cores or more)")
    p.add_argument("--browser", action=argparse.BooleanOptionalAction, default=True,
                   help="time the timeline's opening in a headless Chromium (where one is installed)")
    # internal: one row (node 0), or one worker of simulated nodes
    p.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--nnodes", "--first", "--last", "--port", "--bench-port"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--root", "--row-json"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = parse_args(p, TINY)
    if args.node0_core is None:
        args.node0_core = len(os.sched_getaffinity(0)) >= 2
    if args.node0_core and (args.worker or args.row):
        os.sched_setaffinity(0, cores(args.row))
    if args.worker:
        from _cluster_sim import worker
        worker(args)
        return
    if args.row:
        import distcheck.launch.launcher  # noqa: F401
        from _node0 import Node0
        Path(args.row_json).write_text(json.dumps(Node0(args).run()))
        return
    # a benchmark stopped by SIGTERM (a test's time-out, a job scheduler) ends its rows' process groups, as one
    # stopped by ^C does (``run_row``'s ``finally``): they held the simulated nodes' idle ranks for a day
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rows = []
    cond = {"conditions": conditions(), "ranks_per_node": args.ranks_per_node, "mesh": args.mesh or "flat",
            "records_per_rank": args.records_per_rank, "workers": args.workers, "node_poll_s": args.node_poll_s,
            "stall_timeout": args.stall_timeout, "transport": "c10d TCPStore on loopback",
            "node0_cores": sorted(cores(True)) if args.node0_core else "shared",
            "simulated_nodes_cores": sorted(cores(False)) if args.node0_core else "shared"}
    print(f"conditions: {cond}", flush=True)
    for n in (int(x) for x in args.nodes.split(",")):
        for fault in args.fault.split(","):
            t0 = time.time()
            row = run_row(args, n, fault)
            row["wall_s"] = round(time.time() - t0, 1)
            row["load_after"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(table(COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows],
                title=f"Cluster scale: {args.ranks_per_node} ranks per node, {args.records_per_rank:,} records per rank"))
    if args.json:
        args.json.write_text(json.dumps({"conditions": cond, "rows": rows}, indent=1))
    well_formed({f"{r['nodes']} nodes, {r['fault']}": {k: r.get(k) for k in FIGURES
                                                       if not (k == "hang_named_after_onset_s" and r["fault"] == "straggler_node")}
                 for r in rows}, _checks(rows))


if __name__ == "__main__":
    main()
