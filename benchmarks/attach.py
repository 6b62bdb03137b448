"""``distcheck attach`` on a plain torchrun job with a planted hang (rank 0 in an all_reduce, the others
polling for a file): the time from ``distcheck attach`` to its verdict at 2, 8 and 32 ranks on one node, and
how long each way of reading stops a rank, side by side with a plain ``py-spy dump`` of the same ranks.

The stop is measured from inside each rank (tests/scripts/attach/job.py --ticks: a thread that sleeps 5 ms
at a time logs every gap): the gaps while the reader runs, less the gaps of an equal window with no reader
(the machine's own scheduling noise), summed per rank.

``--hogs N``: the same beside N CPU hogs (busy Python loops, as the acceptance runs use: ``--hogs 4`` is two per
core here), the figures of a loaded node.

With ``--native``: how long one native read stops a rank hung in DDP's reducer (the C++ all_reduce attach reads
native frames for), py-spy's ``--native`` beside pystack's ``remote --native`` and their Python-only reads.

``--nodes 8,64,512``: ``distcheck attach`` on that many simulated nodes meeting through distcheck's store, each
node's real attach-side code over recorded stack samples (``_attach_sim``), one row per ``--fault`` (planted in
the job ``--mesh`` describes, as ``cluster_scale`` plants it): node 0's verdict after the last node's attach started
(its wait for a connect included), after it joined node 0's store (attached: then it reads its ranks, sends its
views, node 0 judges), and after its views came (node 0's own share).

    python benchmarks/attach.py [--ranks 2 8 32] [--repeat 2] [--hogs 4] [--tiny] [--native]
    python benchmarks/attach.py --ranks --nodes 512 --mesh tp=8,pp=4 \
        --fault barrier_absent,tp_group_stall,pp_skip_microbatch,node_lost,straggler_node
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, conditions, kill_tree, median, parse_args, table, well_formed  # noqa: E402

# --tiny: one 2-rank job read for real (py-spy), and 4 simulated nodes of 2 ranks on a tp=2,pp=2 mesh whose TP group
# stalls (``--tiny --ranks``: the simulated nodes alone, as the quick lane runs them; --fault names the others).
TINY = {"ranks": [2], "repeat": 1, "nodes": "4", "ranks_per_node": 2, "mesh": "tp=2,pp=2",
        "fault": "tp_group_stall", "workers": 1}
VERDICT_BOUND_S = {8: 5.0, 32: 10.0}       # one node, beside CPU hogs: attach's verdict
PAUSE_BOUND_MS = 50.0                       # a Python-only read: how long a rank may be held
NODES_VERDICT_BOUND_S = 10.0                # simulated nodes: node 0's verdict after the last node's views came
JOB = REPO / "tests" / "scripts" / "attach" / "job.py"


def start_job(folder: Path, ranks: int, mode: str = "allreduce") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(JOB), mode, str(folder), "--ticks"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not all((folder / f"ready{r}").exists() for r in range(ranks)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {ranks}-rank job did not start")
        time.sleep(0.2)
    time.sleep(2.0)   # the ranks settle into their waits before the baseline window
    return proc


def end_job(folder: Path, proc: subprocess.Popen) -> None:
    (folder / "release").touch()
    kill_tree(proc)   # its ranks too: a loaded rank may not see the release before the folder goes


def stopped(folder: Path, ranks: int, t0: float, t1: float) -> list[float]:
    """Seconds each rank was stopped (gaps over 10 ms) between wall times t0 and t1."""
    out = []
    for r in range(ranks):
        total = 0.0
        for line in (folder / f"ticks{r}").read_text().splitlines() if (folder / f"ticks{r}").exists() else []:
            at, gap = map(float, line.split())
            total += gap if t0 <= at <= t1 + 0.5 else 0.0
        out.append(total)
    return out


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, float, int]:
    t0 = time.time()
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.monotonic() - start, t0, time.time(), done.returncode


def pids(folder: Path, ranks: int) -> list[int]:
    return [int((folder / f"ready{r}").read_text()) for r in range(ranks)]


def one(ranks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = start_job(folder, ranks)
        try:
            t0 = time.time()
            time.sleep(1.5)
            noise = max(stopped(folder, ranks, t0, time.time()))
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            verdict_s, a0, a1, rc = timed([sys.executable, "-m", "distcheck", "attach", str(proc.pid),
                                           "--run-dir", str(folder / "run")], env)
            attach_stop = max(stopped(folder, ranks, a0, a1)) - noise
            plain = []
            for mode in ([], ["--nonblocking"], ["--native"]):
                p0 = time.time()
                spy_s = sum(timed(["py-spy", "dump", "--pid", str(pid), *mode])[0] for pid in pids(folder, ranks))
                plain.append((spy_s, max(stopped(folder, ranks, p0, time.time())) - noise))
        finally:
            end_job(folder, proc)
    return {"verdict_s": verdict_s, "rc": rc, "attach_stop_ms": 1000 * max(0.0, attach_stop),
            "noise_ms": 1000 * noise, "spy_s": plain[0][0], "spy_stop_ms": 1000 * max(0.0, plain[0][1]),
            "nonblock_stop_ms": 1000 * max(0.0, plain[1][1]), "native_stop_ms": 1000 * max(0.0, plain[2][1])}


NATIVE_READERS = {"py-spy dump --native": ["py-spy", "dump", "--native", "--pid"],
                  "pystack remote --native": ["pystack", "remote", "--native"],
                  "py-spy dump --nonblocking": ["py-spy", "dump", "--nonblocking", "--pid"],
                  "pystack remote": ["pystack", "remote"]}


def native_reads(repeat: int) -> None:
    """Rank 0 of a 2-rank DDP job hung in the reducer's all_reduce, read by each reader ``repeat`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = start_job(folder, 2, "ddp")
        try:
            pid = pids(folder, 1)[0]
            rows = []
            for name, cmd in NATIVE_READERS.items():
                took, stop = [], []
                for _ in range(repeat):
                    t0 = time.time()
                    took.append(timed([*cmd, str(pid)])[0])
                    time.sleep(0.3)   # the ticker logs the gap when it wakes
                    stop.append(stopped(folder, 1, t0, time.time())[0])
                rows.append([name, f"{median(took):.2f}", f"{1000 * median(stop):.0f}", f"{1000 * max(stop):.0f}"])
        finally:
            end_job(folder, proc)
    print(table(["reader", "took s", "rank stopped ms (median)", "worst ms"], rows,
                title=f"one read of a rank hung in DDP's reducer ({repeat} reads each; the ticker's gaps)"))


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` busy Python loops, each in a session of its own (ended by ``kill_tree``)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def nodes_rows(args: argparse.Namespace, figures: dict, named: dict) -> None:
    """``distcheck attach`` on simulated nodes: one row per node count and fault."""
    from _attach_sim import simulated

    rows = []
    for nodes in (int(x) for x in args.nodes.split(",") if x):
        for fault in args.fault.split(","):
            row = simulated(nodes, fault, args, __file__)
            print(row, flush=True)
            name = f"{nodes} nodes, {fault}"
            if row.get("verdict_after_last_started_s") is not None:
                figures[name] = {k: row[k] for k in ("verdict_after_last_started_s", "verdict_after_last_joined_s",
                                                     "verdict_after_last_views_s",
                                                     "judge_s", "node_attach_cpu_s") if row.get(k) is not None}
            named[f"{name}: named, no node's error"] = row["named"] and not row["errors"]
            if nodes >= 512 and fault != "node_lost":
                named[f"{name}: node 0's verdict within {NODES_VERDICT_BOUND_S} s of the last node's views"] = \
                    (row.get("verdict_after_last_views_s") or 1e9) <= NODES_VERDICT_BOUND_S
            rows.append([nodes, row["ranks"], fault, row.get("verdict_after_last_started_s"),
                         row.get("verdict_after_last_joined_s"), row.get("verdict_after_last_views_s"), row.get("judge_s"), row.get("node_attach_cpu_s"),
                         row.get("exit_code"), row["named"], (row["findings"] or ["-"])[0][:90]])
    print(table(["nodes", "ranks", "fault", "verdict after last started s", "after last joined s",
                 "after last views s", "judge s",
                 "CPU s per node", "exit", "named", "first finding"], rows,
                title="distcheck attach on simulated nodes (recorded stack samples)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 8, 32])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--hogs", type=int, default=0, help="CPU hogs beside the one-node runs")
    ap.add_argument("--native", action="store_true", help="measure the native readers instead")
    ap.add_argument("--nodes", default="", help="simulated nodes (e.g. 8,64,512): attach across nodes")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--mesh", default=None, help="tp=T,pp=P, as cluster_scale's (none: the flat job)")
    ap.add_argument("--fault", default="barrier_absent")
    ap.add_argument("--workers", type=int, default=4, help="processes of simulated nodes, at least one per 20 nodes")
    ap.add_argument("--lost-wait-s", type=float, default=20.0, help="node_lost: node 0's --rdzv-timeout")
    # internal: one process of simulated nodes
    ap.add_argument("--attach-node", action="store_true", help=argparse.SUPPRESS)
    for name in ("--nnodes", "--first", "--last", "--port", "--bench-port"):
        ap.add_argument(name, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--rdzv-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = parse_args(ap, TINY)
    if args.attach_node:
        from _attach_sim import run_nodes
        run_nodes(args)
        return
    if args.native:
        print(conditions())
        native_reads(max(3, args.repeat))
        return
    print(conditions())
    rows, figures, named = [], {}, {}
    loaded = hogs(args.hogs)
    try:
        one_node_rows(args, rows, figures, named)
    finally:
        for proc in loaded:
            kill_tree(proc)
    if rows:
        print(table(["ranks", "attach→verdict s", "exit (each run)", "attach: worst rank stopped ms",
                     "py-spy dump all s", "py-spy dump: stopped ms", "--nonblocking: ms", "--native: ms", "noise ms"],
                    rows, title=f"distcheck attach vs py-spy by hand (planted hang; median; {args.hogs} CPU hogs; "
                                "stops: the worst rank, noise subtracted)"))
    if args.nodes:
        nodes_rows(args, figures, named)
    well_formed(figures, named)


def one_node_rows(args: argparse.Namespace, rows: list, figures: dict, named: dict) -> None:
    for ranks in args.ranks:
        runs = [one(ranks) for _ in range(args.repeat)]
        m = {k: median(r[k] for r in runs) for k in runs[0]}
        figures[f"{ranks} ranks"] = {k: v for k, v in m.items() if k != "rc"}
        named[f"{ranks} ranks: attach exited 1 (the hang)"] = all(r["rc"] == 1 for r in runs)
        if args.hogs and ranks in VERDICT_BOUND_S:
            named[f"{ranks} ranks beside {args.hogs} hogs: verdict within {VERDICT_BOUND_S[ranks]} s, "
                  f"no rank held over {PAUSE_BOUND_MS} ms"] = \
                m["verdict_s"] <= VERDICT_BOUND_S[ranks] and m["attach_stop_ms"] <= PAUSE_BOUND_MS
        exits = ",".join(str(int(r["rc"])) for r in runs)
        rows.append([ranks, f"{m['verdict_s']:.2f}", exits, f"{m['attach_stop_ms']:.1f}", f"{m['spy_s']:.2f}",
                     f"{m['spy_stop_ms']:.1f}", f"{m['nonblock_stop_ms']:.1f}", f"{m['native_stop_ms']:.1f}",
                     f"{m['noise_ms']:.1f}"])


if __name__ == "__main__":
    main()
