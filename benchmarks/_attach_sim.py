"""``distcheck attach`` across N simulated nodes (a helper of ``benchmarks/attach.py``, not part of distcheck).

Every node runs distcheck's real attach-side code, ``distcheck.attach.session.attach``, with ``--nnodes N
--node-rank n`` meeting node 0's store (``attach.nodes.Meeting`` over ``launch.cluster.ClusterStore``): its
sampling loop (3 samples 0.5 s apart), the positions and views of its ranks, its views sent to node 0; node 0's
gather, judgment (``attach.judge``), report files and the verdict it posts for the others. Node 0 is a process
of its own; the other nodes are threads of a few worker processes, at a lower priority (as in ``cluster_scale``).

Simulated: finding the job's processes (``discover.find_jobs`` answers with the node's ranks) and reading a
rank's stack (``session.sample`` is given a reader of recorded samples instead of py-spy). A sample is what
``py-spy dump --json`` printed for a real gloo rank waiting in ``all_reduce`` (``RECORDED``: torch's two frames,
then the script's), with the script's frames those of the rank's call in the fault's plan (``_faults``, on the
job's mesh) and torch's function that call's; a straggler's stack moves between samples, a rank absent from the
barrier polls at its own line. The real parser (``attach.read.parse_dump``) reads them. Each rank's process is an
idle process of its own: its /proc counters and state are real (asleep, no CPU). A lost node's attach never comes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _faults import Plan, last_ops
from _mesh import LINES, SYNTHETIC_FILE, Mesh, Model

# py-spy dump --json of rank 0 of tests/scripts/attach/job.py (allreduce), torch 2.13: the main thread's frames
# inside torch (function, file under torch's folder, line), innermost first; the job's frames followed.
RECORDED = [("all_reduce", "distributed/distributed_c10d.py", 3252),
            ("_exception_logger.<locals>.wrapper", "distributed/c10d_logger.py", 83)]
WORKER_NICE = 10
NODES_PER_WORKER = 20
ABSENT_LINE = (520, "wait_for_checkpoint")   # where a rank that left the training loop polls


def _torch_line(fn: str) -> int:
    import torch.distributed as dist

    if fn == "all_reduce":
        return RECORDED[0][2]
    target = inspect.unwrap(getattr(dist, fn))
    return inspect.getsourcelines(target)[1] + 1


def sample_json(pid: int, rank: int, mesh: Mesh, model: Model, plan: Plan, moved: int) -> str:
    """One recorded sample of ``rank``: where the fault's plan puts it (``moved``: how many times a computing rank's
    stack moved)."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    at, entered = plan.where(rank)
    ops = last_ops(mesh, model, plan, rank)
    frames = []
    if entered and at < len(ops):
        op = ops[at]
        line, function = LINES[op.kind]
        frames += [{"name": op.fn, "filename": f"{torch_dir}/{RECORDED[0][1]}", "line": _torch_line(op.fn)},
                   {"name": RECORDED[1][0], "filename": f"{torch_dir}/{RECORDED[1][1]}", "line": RECORDED[1][2]},
                   {"name": function, "filename": SYNTHETIC_FILE, "line": line}]
    elif rank in plan.finished:
        frames.append({"name": "sleep", "filename": "/usr/lib/python3/time.py", "line": 1})
        frames.append({"name": ABSENT_LINE[1], "filename": SYNTHETIC_FILE, "line": ABSENT_LINE[0]})
    elif plan.straggler and rank in plan.ranks:   # a straggler computing: its stack moves from function to function
        # (an idle process stands for the rank here, so its /proc counters show no CPU: the moving stack is the
        # evidence of its work that attach reads)
        frames.append({"name": ("forward", "backward", "optimizer_step")[moved % 3], "filename": SYNTHETIC_FILE,
                       "line": 100 + moved % 17})
    else:   # short of its next call where the fault left it, in one function: no progress
        frames.append({"name": "forward", "filename": SYNTHETIC_FILE, "line": 100 + moved % 17})
    frames += [{"name": "train_step", "filename": SYNTHETIC_FILE, "line": 450},
               {"name": "<module>", "filename": SYNTHETIC_FILE, "line": 600}]
    return json.dumps([{"thread_name": "MainThread", "os_thread_id": pid, "active": not entered, "frames": frames}])


class Recorded:
    """``read_stacks`` for the simulated ranks: each read a recorded sample, parsed by attach's own parser."""

    def __init__(self, mesh: Mesh, model: Model, plan: Plan) -> None:
        self.mesh, self.model, self.plan = mesh, model, plan
        self.rank_of: dict[int, int] = {}
        self._reads: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self, pid: int, *, native: bool = False, with_locals: bool = False, timeout_s: float = 5.0) -> Any:
        from distcheck.attach.read import parse_dump

        with self._lock:
            n = self._reads[pid] = self._reads.get(pid, 0) + 1
        rank = self.rank_of[pid]
        return parse_dump(pid, sample_json(pid, rank, self.mesh, self.model, self.plan, n), 0.005)


def _job(ranks: list[int], pids: dict[int, int], world: int) -> Any:
    from distcheck.attach.discover import Job, RankProc

    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "sim"}
    return Job("the simulated job", tuple(RankProc(pids[r], r, world, {**env, "RANK": str(r)}) for r in ranks))


def install(recorded: Recorded) -> threading.local:
    """The two simulated parts, in this process: the job's processes and the stack reader. Returns where each
    node's thread puts its own job."""
    from distcheck.attach import discover, session

    from distcheck.launch import cluster

    mine = threading.local()
    discover.find_jobs = lambda *args, **kwargs: discover.Found((mine.job,))
    sample = functools.partial(session.sample, read=recorded)

    def sampled(*args: Any, **kwargs: Any) -> Any:   # when this node's samples were all read
        out = sample(*args, **kwargs)
        mine.sampled = time.time()
        return out

    session.sample = sampled
    # One node of this process connects to node 0's store at a time, as in cluster_scale: on a cluster each node
    # connects from a machine of its own (and its quiet_native_stderr holds: one thread); 128 threads at once here
    # timed out their 1 s connect slices and printed c10d's backtraces over each other.
    connect, lock = cluster._connect, threading.Lock()

    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with lock:
            began = time.time()
            out = connect(*args, **kwargs)
        mine.connected = time.time()
        mine.connect_s = getattr(mine, "connect_s", 0.0) + mine.connected - began
        return out

    cluster._connect = one_at_a_time
    from distcheck.attach.nodes import Meeting

    send = Meeting.send

    def sent(self: Any, views: Any) -> None:   # this node's views are in node 0's store
        send(self, views)
        mine.sent = time.time()

    Meeting.send = sent
    return mine


def options(args: argparse.Namespace, node: int, pids: tuple[int, ...]) -> Any:
    from distcheck.attach.session import AttachOptions
    from distcheck.launch.node_config import NodeConfig

    nodes = NodeConfig(nnodes=args.nnodes, node_rank=node, rdzv_endpoint=f"127.0.0.1:{args.port - 1}",
                       rdzv_id="attach-sim", rdzv_timeout=args.rdzv_timeout, store_port=args.port)
    return AttachOptions(pids=pids, samples=3, interval_s=0.5, run_dir=Path(args.root) / f"run{node}", nodes=nodes)


def load(args: argparse.Namespace) -> tuple[Mesh, Model, Plan]:
    spec = json.loads((Path(args.root) / "job.json").read_text())
    return Mesh(**spec["mesh"]), Model(**spec["model"]), Plan(**json.loads((Path(args.root) / "plan.json").read_text()))


def run_nodes(args: argparse.Namespace) -> None:
    """A process of nodes ``args.first`` .. ``args.last`` (node 0: the one that judges), each attaching on a thread
    of its own; what each measured goes to the benchmark's store."""
    from torch.distributed import TCPStore

    from distcheck.attach import session

    if args.first > 0:
        os.nice(WORKER_NICE)
    mesh, model, plan = load(args)
    rpn = args.ranks_per_node
    nodes = [n for n in range(args.first, args.last + 1) if n != plan.lost_node]
    ranks = {n: list(range(n * rpn, (n + 1) * rpn)) for n in nodes}
    idle = {r: subprocess.Popen(["sleep", "86400"]) for n in nodes for r in ranks[n]}
    _settled(list(idle.values()))
    recorded = Recorded(mesh, model, plan)
    recorded.rank_of = {p.pid: r for r, p in idle.items()}
    mine = install(recorded)
    bench = TCPStore("127.0.0.1", args.bench_port, is_master=False, timeout=datetime.timedelta(seconds=900))
    marks: dict[int, dict[str, float]] = {}
    judged = _timed_judge(session)
    told = session.Attached.tell_nodes

    def tell_nodes(self: Any) -> None:   # node 0's verdict is out: its report written, the others may read it
        judged["verdict"] = time.time()
        told(self)

    session.Attached.tell_nodes = tell_nodes

    def node(n: int) -> None:
        mine.job = _job(ranks[n], {r: idle[r].pid for r in ranks[n]}, mesh.world)
        marks[n] = {"attached": time.time()}
        try:
            attached = session.attach(options(args, n, tuple(idle[r].pid for r in ranks[n])))
            marks[n]["code"] = attached.exit_code
            marks[n]["sampled"] = getattr(mine, "sampled", None)
            marks[n]["connected"] = getattr(mine, "connected", None)
            marks[n]["sent"] = getattr(mine, "sent", None)
            marks[n]["connect_s"] = getattr(mine, "connect_s", None)
            if n == 0:
                result = attached.report.scenarios[0]
                marks[n]["findings"] = [f"{f.kind}: {f.summary[:300]}" for f in result.findings][:8]
                marks[n]["run_dir"] = attached.report.run.run_dir
        except Exception as exc:   # the row says so
            marks[n]["error"] = f"{type(exc).__name__}: {exc}"
        marks[n]["done"] = time.time()

    bench.add("attach/ready", 1)
    bench.wait(["attach/go"])
    cpu = time.process_time()
    threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu   # this process's nodes' attach, each node's share of it below
    for n in nodes:
        marks[n]["cpu_s"] = cpu / len(nodes)
    if 0 in marks:
        marks[0].update(judged)
    bench.set(f"attach/marks/{args.first}", json.dumps(marks))
    for proc in idle.values():
        proc.kill()
        proc.wait()


def _settled(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Every idle rank has started sleeping: a process still starting reads its libraries, and attach would count
    those reads as I/O made by a rank (a late rank, at 1 KiB/s), which no sleeping rank makes."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{proc.pid}/stat").read_text()
                if "(sleep)" in stat and stat.rpartition(")")[2].split()[0] == "S":
                    break
            except OSError:
                break
            time.sleep(0.01)


def _timed_judge(session: Any) -> dict[str, float]:
    """When node 0's judgment began and ended (``attach.judge.judge``, as ``session`` calls it)."""
    out: dict[str, float] = {}
    inner = session.judge

    def judge(*args: Any, **kwargs: Any) -> Any:
        out["judge_start"] = time.time()
        try:
            return inner(*args, **kwargs)
        finally:
            out["judge_end"] = time.time()

    session.judge = judge
    return out


def prepare(root: Path, mesh_text: str | None, fault: str, nodes: int, rpn: int) -> Plan:
    from dataclasses import asdict

    from _faults import plan

    mesh = Mesh.parse(mesh_text, nodes * rpn)
    model = Model(eval_every=0 if mesh.flat else 10)
    planned = plan(fault, mesh, model, rpn)
    root.mkdir(parents=True, exist_ok=True)
    (root / "job.json").write_text(json.dumps({"mesh": asdict(mesh), "model": asdict(model)}))
    (root / "plan.json").write_text(json.dumps(asdict(planned)))
    return planned


def simulated(nodes: int, fault: str, args: argparse.Namespace, script: str) -> dict[str, Any]:
    """One row: node 0's attach (a process of its own) and N-1 simulated nodes' (``args.workers`` processes)."""
    import shutil
    import sys
    import tempfile

    from torch.distributed import TCPStore

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import free_port

    root = Path(tempfile.mkdtemp(prefix=f"distcheck-attach-{nodes}-"))
    planned = prepare(root, args.mesh, fault, nodes, args.ranks_per_node)
    bench_port, port = free_port(), free_port()
    bench = TCPStore("127.0.0.1", bench_port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=900))
    # a lost node's attach never comes: node 0 waits --rdzv-timeout for it
    rdzv_timeout = args.lost_wait_s if planned.lost_node is not None else 300.0
    common = ["--nnodes", str(nodes), "--port", str(port), "--bench-port", str(bench_port), "--root", str(root),
              "--ranks-per-node", str(args.ranks_per_node), "--rdzv-timeout", str(rdzv_timeout)]
    others = list(range(1, nodes))
    # at most NODES_PER_WORKER nodes a process: one process's 26th TCPStore connect (and every 26th after it) stalls
    # 5 s in c10d's client on this host, whatever the server (measured: 60 connects in a row, libuv or not), where
    # a real node connects once; 128 nodes a process made "the last node attached" wait 98 s at 512 nodes
    size = min(NODES_PER_WORKER, -(-len(others) // max(1, args.workers))) if others else 1
    chunks = [[0, 0]] + [[c[0], c[-1]] for c in (others[i:i + size] for i in range(0, len(others), size))]
    procs = [subprocess.Popen([sys.executable, script, "--attach-node", "--first", str(a), "--last", str(b), *common],
                              start_new_session=True) for a, b in chunks]
    try:
        while int(bench.add("attach/ready", 0)) < len(procs):
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"an attach process ended before it started: {[p.returncode for p in procs]}")
            time.sleep(0.2)
        bench.set("attach/go", "1")
        for p in procs:
            p.wait(timeout=900)
        marks: dict[str, Any] = {}
        for a, _ in chunks:
            marks.update(json.loads(bench.get(f"attach/marks/{a}")))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        shutil.rmtree(root, ignore_errors=True)
    return _row(nodes, fault, planned, marks)


def _row(nodes: int, fault: str, planned: Plan, marks: dict[str, Any]) -> dict[str, Any]:
    node0 = marks["0"]
    attached = max(m["attached"] for m in marks.values())
    findings = node0.get("findings", [])
    sampled = [m["sampled"] for m in marks.values() if m.get("sampled")]
    connected = [m["connected"] for m in marks.values() if m.get("connected")]
    sent = [m["sent"] for m in marks.values() if m.get("sent")]
    errors = [f"node {n}: {m['error']}" for n, m in marks.items() if "error" in m]
    return {
        "nodes": nodes, "ranks": len(planned.stand),
        "fault": fault, "exit_code": node0.get("code"),
        # from the last node's ``distcheck attach`` started (its wait for this process's connect lock included)
        "verdict_after_last_started_s": round(node0["verdict"] - attached, 2) if "verdict" in node0 else None,
        # from the last node joined node 0's store (attached: its ranks' samples, its views sent, node 0's judgement)
        "verdict_after_last_joined_s": round(node0["verdict"] - max(connected), 2)
        if connected and "verdict" in node0 else None,
        # node 0's own share: from the last node's views in its store to its verdict (the simulated nodes' sampling
        # on this host's cores, before it, is the simulation's: a real node samples its 8 ranks on its own machine)
        # what one simulated node's attach cost in CPU (its process's CPU over its nodes): on a cluster, a node's own
        "node_attach_cpu_s": round(sorted(m["cpu_s"] for n, m in marks.items() if str(n) != "0" and "cpu_s" in m)
                                   [len(marks) // 2 - 1], 3) if len(marks) > 1 else None,
        "verdict_after_last_views_s": round(node0["verdict"] - max(sent), 2) if sent and "verdict" in node0
        else None,
        "judge_s": round(node0["judge_end"] - node0["judge_start"], 2) if "judge_end" in node0 else None,
        "last_attached_after_first_s": round(attached - min(m["attached"] for m in marks.values()), 2),
        # every node connected to node 0's store, every node's samples read (3, 0.5 s apart: 1 s at the least),
        # then node 0's gather of the views
        "last_node_connected_after_attached_s": round(max(connected) - attached, 2) if connected else None,
        "connect_s_max": max((m.get("connect_s") or 0 for m in marks.values()), default=None),
        "connect_s_total": round(sum(m.get("connect_s") or 0 for m in marks.values()), 1),
        "connects_over_1s": sum(1 for m in marks.values() if (m.get("connect_s") or 0) > 1),
        "last_node_sampled_after_attached_s": round(max(sampled) - attached, 2) if sampled else None,
        "node0_judged_after_last_sampled_s": round(node0["judge_start"] - max(sampled), 2)
        if sampled and "judge_start" in node0 else None,
        "every_node_done_s": round(max(m["done"] for m in marks.values()) - attached, 2),
        "findings": findings, "errors": errors[:5],
        "named": attach_named(planned, findings, node0.get("code")),
    }


def rank_sets(text: str) -> list[set[int]]:
    """Every rank list a sentence names (``rank 7``, ``ranks 2, 3, 6, 7``, ``ranks 0-4090, 4092-4095``), each as
    the set of its ranks: a verdict's ranks compared whole, not as a substring (``6, 7`` is in ``16, 17``)."""
    import re

    out = []
    for match in re.finditer(r"\branks? (\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)", text, flags=re.IGNORECASE):
        ranks: set[int] = set()
        for part in match.group(1).split(", "):
            a, _, b = part.partition("-")
            ranks.update(range(int(a), int(b or a) + 1))
        out.append(ranks)
    return out


def attach_named(planned: Plan, findings: list[str], code: int | None) -> bool:
    """What attach's verdict must say of each fault, read from outside (no sequence numbers, no groups): a hang or
    mismatch finding first that names the ranks the fault was planted on, as a list of their own (the absent rank;
    the stalled TP group's ranks, in its all_reduce); for a skipped micro-batch, a rank of the skipping stage's
    pipeline; a lost node: that node, as the one whose attach never came; a straggler is no hang."""
    first = findings[0] if findings else ""
    if planned.fault == "straggler_node":
        return not any(f.startswith("hang") for f in findings) and code == 0
    if planned.fault == "node_lost":
        return any(f"node(s) {planned.node} " in f or f"node {planned.node} " in f for f in findings)
    if not first.startswith(("hang", "mismatch")) or code in (0, None):
        return False
    named = rank_sets(first)
    if planned.fault == "pp_skip_microbatch":
        return any(ranks & set(planned.ranks) for ranks in named)
    return set(planned.ranks) in named
