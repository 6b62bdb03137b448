"""Cluster scale: node 0's real code judging N simulated nodes over a real c10d TCPStore on loopback.

Node 0 (one process per row, so its peak RSS is its own) hosts distcheck's ``ClusterStore`` and runs
the real ``Watchdog`` with its ``LaunchChannel`` (liveness, the merge of every node's progress, the
wait-for graph), then the real post-launch path: every node's upload, ``gather``, the merge of the
node summaries, ``judged_across_nodes`` (collect + diagnose, as node 0 runs it) and every report format.

The other N-1 nodes are threads spread over a few worker processes. Each is distcheck's real
node-side code with its own store connections: ``ClusterStore`` (a client and its heartbeat thread),
a real ``Watchdog`` over its own launch dir (publishing progress, following node 0's decision; a worker
polls all its nodes' watchdogs from one thread, each through the watchdog's own ``poll_once``), then
``upload`` and ``result``. Its ranks are not processes: each rank is a trace file written by the
real tracer (``--records-per-rank`` records: an E and an X record per completed all_reduce) and a
status file whose pid is one idle process per node (alive, using no CPU; the node's teardown ends it).

The planted certain hang: at a moment node 0 picks, one rank of the last node writes that it
finished, and every other rank enters a barrier at ``/synthetic/train.py:BARRIER_LINE`` (the
tracer's enter record, then the sidecar's sync record). The onset is when the last of these writes
landed; ``hang_named_after_onset_s`` is node 0's decision time minus the onset.

    python benchmarks/cluster_scale.py --nodes 8,64,512 --ranks-per-node 8 --records-per-rank 10000 \\
        --json cluster_scale.json
    python benchmarks/cluster_scale.py --tiny     # 2 nodes of 2 ranks: the same code, in seconds

What is not simulated: a real network (loopback only), real NCCL or gloo, real ranks' CPU and the
rendezvous of torch's agent. ``--node-poll-s`` is the simulated nodes' watchdog poll interval
(a real node polls every 0.1 s with a machine of its own; here all of them share the CPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import conditions, free_port, median, parse_args, table, well_formed  # noqa: E402

BARRIER_LINE = 412
STEP_LINE = 380
SYNTHETIC_FILE = "/synthetic/train.py"
LAUNCH = "bench"
FINISHED_LOCAL_RANK = 3        # of the last node: the planted rank that finished (its last rank on a smaller node)
# The simulated nodes' processes run at a lower priority than node 0's. On a cluster node 0 has a machine of
# its own, and the other nodes' polls and uploads never take its CPU; here they share two cores with it, and
# at 512 nodes their burst when the hang begins held node 0's poll off the cores for up to 0.4 s.
WORKER_NICE = 10
# --tiny: node 0 and one simulated node in one worker, 2 ranks each, the same planted hang and judgment
TINY = {"nodes": "2", "ranks_per_node": 2, "records_per_rank": 20, "workers": 1, "settle_s": 0.3}
FIGURES = ("hang_named_after_onset_s", "node0_peak_rss_mib", "report_after_decision_s", "poll_s_median",
           "store_bytes_total", "upload_bytes_per_node", "gather_s", "judge_s", "reports_s")


# -- synthetic ranks, written by the real tracer -------------------------------------------------


def templates(world: int, calls: int) -> tuple[bytes, bytes]:
    """(prefix, barrier): a rank's trace file after ``calls`` completed all_reduces, as it is on disk (its
    records, then the zeros of the writer's preallocated end), and the bytes the tracer writes after those
    records when the rank enters the barrier (its definitions and its E record). Written by the real
    ``Tracer`` into a real trace file; the barrier's bytes are read while the call is inside it."""
    import torch
    from torch.distributed import ReduceOp

    from distcheck.files.trace import used_bytes
    from distcheck.files.trace_reader import read_trace_bytes
    from distcheck.rank.tracer import Tracer

    tmp = Path(tempfile.mkdtemp(prefix="distcheck-cluster-tpl-"))
    path = tmp / "rank0.trace"
    world_group = object()
    tracer = Tracer(path, 0, group_resolver=lambda pg: ("0", tuple(range(world))), default_group=lambda: world_group)
    seen: dict[str, bytes] = {}

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return None

    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        seen["inside"] = read_trace_bytes(path)   # the E record is in the mapping before the backend sees the call
        return None

    # The calls come from lines of a synthetic training script, as the call-site resolver sees them.
    source = "\n" * (STEP_LINE - 2) + "def step(ar, t):\n    ar(t)\n" + "\n" * (BARRIER_LINE - STEP_LINE - 2) + \
        "def end(b):\n    b()\n"
    code: dict[str, Any] = {}
    exec(compile(source, SYNTHETIC_FILE, "exec"), code)
    ar, b = tracer.wrap("all_reduce", all_reduce), tracer.wrap("barrier", barrier)
    t = torch.ones(256)
    for _ in range(calls):
        code["step"](ar, t)
    prefix = path.read_bytes()
    code["end"](b)
    tracer.close()
    shutil.rmtree(tmp, ignore_errors=True)
    inside, used = seen["inside"], used_bytes(prefix)
    assert inside.startswith(prefix[:used]) and len(inside) > used
    return prefix, inside[used:]


def finished_rank(nodes: int, rpn: int) -> int:
    """The planted rank that finished: of the last node, never past its last rank (with none finished, every
    rank would wait in the barrier: a hang no wait-for graph can call certain)."""
    return (nodes - 1) * rpn + min(FINISHED_LOCAL_RANK, rpn - 1)


def write_ranks(files: Any, ranks: range, node: int, prefix: bytes, pid: int) -> None:
    from distcheck.files.launch_dir import RankStatus
    from distcheck.models import Phase

    files.make()
    for rank in ranks:
        files.trace(rank).write_bytes(prefix)
        files.write_status(rank, RankStatus(rank=rank, pid=pid, host="sim", node=node, t_start=time.time(),
                                            phase=Phase.RUNNING, t_update=time.time(), pg_initialized=True))


def plant(files: Any, ranks: range, node: int, barrier: bytes, finished: int | None) -> None:
    """Every rank of ``ranks`` enters the barrier (its enter record, then its sidecar's sync record),
    except ``finished``, which says it finished."""
    from distcheck.files.trace import SYNC_OFFSET, sync_slot, used_bytes
    from distcheck.models import Phase

    for rank in ranks:
        if rank == finished:
            status = files.read_status(rank)
            files.write_status(rank, dataclasses.replace(status, phase=Phase.FINISHED, t_update=time.time()))
            continue
        with open(files.trace(rank), "r+b") as f:
            f.seek(used_bytes(f.read()))   # after its records, over the zeros of the preallocated end
            # the enter record carries the time it was written: re-stamp the template's
            f.write(_restamp(barrier, time.time_ns()))
            f.seek(SYNC_OFFSET)
            f.write(sync_slot(time.time_ns(), 0, False))


def _restamp(records: bytes, t_ns: int) -> bytes:
    """The barrier's bytes with its E record's time set to ``t_ns`` (the last slot is the E record)."""
    from distcheck.files.trace import SLOT, SLOT_STRUCT, slot

    w0, w1, _, _ = SLOT_STRUCT.unpack_from(records, len(records) - SLOT)
    return records[:-SLOT] + slot(w0, w1, t_ns)


# -- counting what crosses the store ---------------------------------------------------------------


class Counted:
    """A store's methods as the channel calls them, counting payload bytes (keys and values, both ways)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.bytes = 0
        self.lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self.lock:
            self.bytes += n

    def set(self, key: str, value: Any) -> None:
        self._count(len(key) + len(value))
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._count(len(key) + len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._count(sum(map(len, keys)) + sum(map(len, values)))
        return values

    def check(self, keys: list[str]) -> bool:
        self._count(sum(map(len, keys)) + 1)
        return self._store.check(keys)

    def add(self, key: str, n: int) -> int:
        self._count(len(key) + 16)
        return self._store.add(key, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def counted_channel(cluster: Any, world: int) -> tuple[Any, Counted]:
    channel = cluster.launch(LAUNCH, world)
    counter = Counted(channel.store)
    channel.store = counter
    if channel.is_leader:
        cluster.liveness.store = Counted(cluster.liveness.store)
    return channel, counter


def stamped(channel: Any, counter: Counted, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """When each of the channel's ``names`` started and ended, node 0's peak RSS then, and the store bytes it
    sent: the steps of the real judgment, timed from outside it."""
    steps: dict[str, dict[str, float]] = {}

    def timed(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = counter.bytes
            step = steps.setdefault(name, {"start": time.time(), "rss_start": _peak_rss_mib()})
            try:
                return call(*args, **kwargs)
            finally:
                step.update(end=time.time(), rss_end=_peak_rss_mib(), bytes=counter.bytes - before)
        return wrapper

    for name in names:
        setattr(channel, name, timed(name, getattr(channel, name)))
    return steps


def _config(nodes: int, node: int, port: int) -> Any:
    from distcheck.launch.node_config import NodeConfig

    return NodeConfig(nnodes=nodes, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port - 1}", rdzv_id="scale",
                      rdzv_timeout=300.0, store_port=port)


def _limits() -> Any:
    from distcheck.launch.watchdog import Limits

    return Limits(stall_timeout=60.0, startup_timeout=300.0)


# -- a worker process: many simulated nodes ---------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Nodes ``args.first`` .. ``args.last`` of the job, each a thread with distcheck's node-side code."""
    from torch.distributed import TCPStore

    os.nice(WORKER_NICE)

    from distcheck.launch.cluster import ClusterStore
    from distcheck.launch.launcher import LaunchOutcome, node_summary
    from distcheck.launch.watchdog import Watchdog
    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.models import EndReason

    nodes, rpn = args.nnodes, args.ranks_per_node
    world = nodes * rpn
    prefix, barrier = Path(args.tpl_prefix).read_bytes(), Path(args.tpl_barrier).read_bytes()
    bench = TCPStore("127.0.0.1", args.bench_port, is_master=False, timeout=datetime.timedelta(seconds=300))
    mine = range(args.first, args.last + 1)
    dirs = {n: LaunchFiles(Path(args.root) / f"node{n}" / LAUNCH) for n in mine}
    # One idle process per node stands for its ranks' processes: each node's teardown ends its own (a node
    # that found its ranks' process already gone would report them as exited inside the barrier). On a real
    # cluster each node's distcheck is a process of its own, so its last-line ``kill_descendants`` reaches
    # only its own ranks; here the nodes share a worker process, so each idle process is kept out of that
    # sweep (``procs.keep``): the first node to tear down would otherwise end every sibling node's ranks,
    # which then report them as having exited inside the barrier (a crash, not the planted hang).
    from distcheck.launch import procs

    idle = {n: subprocess.Popen(["sleep", "86400"]) for n in mine}
    for proc in idle.values():
        procs.keep(proc.pid)
    for n in mine:
        write_ranks(dirs[n], range(n * rpn, (n + 1) * rpn), n, prefix, idle[n].pid)
    uploaded: dict[int, int] = {}
    ended: dict[int, tuple[float, float]] = {}   # node -> (its ranks torn down, its upload sent), wall time
    errors: list[str] = []
    published: dict[int, float] = {}        # node -> when it first published every rank of its own in the hang
    first_published: set[int] = set()       # nodes whose watchdog has published their ranks once
    node_polls: list[float] = []            # the nodes' own polls (their ranks' files), seconds each

    watched: list[tuple[int, Any, threading.Event]] = []   # (node, its watchdog, set when its watch is over)
    watched_lock = threading.Lock()

    def node(n: int) -> None:
        try:
            cluster = ClusterStore(_config(nodes, n, args.port))
            channel, counter = counted_channel(cluster, world)
            dog = Watchdog(dirs[n], world, _limits(), poll_s=args.node_poll_s, channel=channel)
            _watch_node(n, dog, channel, published, node_polls, first_published)
            over = threading.Event()
            started = time.time()
            with watched_lock:
                watched.append((n, dog, over))
            over.wait()
            outcome = LaunchOutcome(dog.result.decision.end_reason or EndReason.COMPLETED, started, time.time(),
                                    dog.result)
            before = counter.bytes
            channel.upload(dirs[n], node_summary(outcome))
            uploaded[n] = counter.bytes - before
            ended[n] = (dog.result.torn_down_at or time.time(), time.time())
            channel.result(timeout_s=600)
            bench.add("bench/store_bytes", counter.bytes)
        except Exception as exc:   # the row says so instead of hanging
            errors.append(f"node {n}: {type(exc).__name__}: {exc}")

    def watch_all() -> None:
        """Every watchdog of this worker's nodes, each polled every ``--node-poll-s`` by its own
        ``poll_once`` (what its thread would run), from this one thread: 128 watchdog threads per process
        spent the two cores switching between themselves."""
        pending = len(mine)
        while pending:
            began = time.monotonic()
            with watched_lock:
                current = list(watched)
            for n, dog, over in current:
                if not over.is_set() and dog.poll_once():
                    over.set()
                    pending -= 1
            if len(current) < len(mine) or pending:
                time.sleep(max(0.0, args.node_poll_s - (time.monotonic() - began)))

    threads = [threading.Thread(target=node, args=(n,), daemon=True) for n in mine]
    for t in threads:
        t.start()
    threading.Thread(target=watch_all, daemon=True).start()
    # Ready once every node of this worker has published its ranks once: its store connections are up and
    # its watchdog polls. (Counting a node ready when its thread started put nodes whose connection was
    # still being retried in the row: at 64 nodes, some first polled seconds after the onset, and their
    # late start was counted as detection time.)
    while len(first_published) < len(mine) and not errors:
        time.sleep(0.05)
    bench.add("bench/ready", len(mine))
    bench.wait(["bench/onset_at"])
    at = float(bench.get("bench/onset_at"))
    time.sleep(max(0.0, at - time.time()))
    finished = finished_rank(nodes, rpn)
    for n in mine:
        plant(dirs[n], range(n * rpn, (n + 1) * rpn), n, barrier, finished)
    bench.set(f"bench/planted/{args.first}", repr(time.time()))
    for t in threads:
        t.join()
    bench.set(f"bench/uploads/{args.first}", json.dumps(uploaded))
    bench.set(f"bench/ended/{args.first}", json.dumps(ended))
    bench.set(f"bench/published/{args.first}", json.dumps({"at": published, "polls": node_polls[-2000:]}))
    bench.set(f"bench/errors/{args.first}", json.dumps(errors))
    for proc in idle.values():
        proc.kill()
        proc.wait()


def _watch_node(n: int, dog: Any, channel: Any, published: dict[int, float], polls: list[float],
                first: set[int]) -> None:
    """Times a simulated node's own polls, and when it first published its ranks in the planted hang."""
    inner_poll, inner_publish = dog.monitor.poll, channel.publish

    def poll() -> Any:
        t = time.perf_counter()
        out = inner_poll()
        polls.append(time.perf_counter() - t)
        return out

    def publish(progress: Any) -> None:
        inner_publish(progress)
        if progress:
            first.add(n)
        if n not in published and progress and all(p.waits or p.finished for p in progress.values()) \
                and any(p.waits for p in progress.values()):
            published[n] = time.time()

    dog.monitor.poll, channel.publish = poll, publish


# -- node 0 --------------------------------------------------------------------------------------------


def node0(args: argparse.Namespace) -> dict[str, Any]:
    """One row: node 0's real code against ``args.nnodes - 1`` simulated nodes."""
    from torch.distributed import TCPStore

    from distcheck.launch.cluster import ClusterStore
    from distcheck.launch.launcher import LaunchOutcome
    from distcheck.launch.watchdog import Watchdog
    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.models import EndReason, Report
    from distcheck.options import RunOptions
    from distcheck.session import run_info
    from distcheck.targets.launching import judged_across_nodes
    from distcheck.targets.script import ScriptTarget

    nodes, rpn = args.nnodes, args.ranks_per_node
    world = nodes * rpn
    root, port = Path(args.root), args.port
    prefix, barrier = Path(args.tpl_prefix).read_bytes(), Path(args.tpl_barrier).read_bytes()
    bench = TCPStore("127.0.0.1", args.bench_port, is_master=False, timeout=datetime.timedelta(seconds=600))
    cluster = ClusterStore(_config(nodes, 0, port))
    channel, counter = counted_channel(cluster, world)
    files = LaunchFiles(root / "node0" / LAUNCH)
    idle = subprocess.Popen(["sleep", "86400"])
    write_ranks(files, range(rpn), 0, prefix, idle.pid)
    others = list(range(1, nodes))
    poll_costs: list[float] = []
    phases: list[dict[str, float]] = []
    dog = Watchdog(files, world, _limits(), channel=channel)
    _time_polls(dog, poll_costs, phases)
    started = time.time()
    dog.start()
    deadline = time.monotonic() + 600
    while int(bench.add("bench/ready", 0)) < nodes - 1:
        if time.monotonic() > deadline:
            raise SystemExit("the simulated nodes did not start")
        time.sleep(0.2)
    time.sleep(args.settle_s)                 # every node beating and publishing, node 0 polling
    healthy = list(poll_costs)
    onset_at = time.time() + 1.0
    bench.set("bench/onset_at", repr(onset_at))
    time.sleep(max(0.0, onset_at - time.time()))
    plant(files, range(rpn), 0, barrier, None)
    node0_done = time.time()
    dog.join(timeout=600)
    decided = time.time()
    planted = [float(bench.get(f"bench/planted/{c[0]}")) for c in _contiguous(others, args.workers)]
    onset = max([node0_done] + planted)
    detected = dog.result.detected_at or decided

    # The launch's end on node 0: the real judgment (targets.launching.judged_across_nodes), its steps
    # timed where they cross the channel.
    outcome = LaunchOutcome(dog.result.decision.end_reason or EndReason.COMPLETED, started, time.time(), dog.result)
    rss_at = {"decided": _peak_rss_mib()}
    steps = stamped(channel, counter, ("upload", "gather", "post_result"))
    options = RunOptions(nproc_per_node=rpn, backend="gloo", stall_timeout=60.0, nodes=_config(nodes, 0, port),
                         run_dir=root / "run")
    target = ScriptTarget(name=LAUNCH, file=SYNTHETIC_FILE, expect=("hang",))
    result = judged_across_nodes(target, options, files.root, outcome, channel)
    upload0 = steps["upload"]["bytes"]
    gathered, judged, verdict_read = steps["gather"]["end"], steps["post_result"]["start"], steps["post_result"]["end"]
    rss_at["gathered"], rss_at["judged"] = steps["gather"]["rss_end"], steps["post_result"]["rss_start"]
    report = Report(run=run_info(options, files.root.parent, started), scenarios=(result,))
    sizes = write_reports(report, files, root / "reports")
    reported = time.time()

    bench.wait([f"bench/errors/{c[0]}" for c in _contiguous(others, args.workers)])
    store_bytes = counter.bytes + cluster.liveness.store.bytes + int(bench.add("bench/store_bytes", 0))
    uploads = [upload0]
    errors = []
    published_at: list[float] = []
    node_polls: list[float] = []
    ended: list[tuple[float, float]] = []
    for c in _contiguous(others, args.workers):
        uploads += json.loads(bench.get(f"bench/uploads/{c[0]}")).values()
        ended += json.loads(bench.get(f"bench/ended/{c[0]}")).values()
        errors += json.loads(bench.get(f"bench/errors/{c[0]}"))
        got = json.loads(bench.get(f"bench/published/{c[0]}"))
        published_at += got["at"].values()
        node_polls += got["polls"]
    last_published = max(published_at) if len(published_at) == nodes - 1 else None
    idle.kill()
    hang = next((f for f in result.findings if f.kind == "hang"), None)
    named = hang is not None and finished_rank(nodes, rpn) in hang.absent_ranks \
        and f"{hang.callsite}:".startswith(f"{SYNTHETIC_FILE}:{BARRIER_LINE}:")
    # Where the time from the onset to the decision went: until node 0 saw every rank but the planted one
    # waiting (the simulated nodes polling their files and publishing), then node 0's own polls.
    after = [p for p in phases if p["t"] + p["local"] + p["channel"] >= onset - 0.5]
    all_in = next((p for p in after if p["waiting"] >= world - 1), None)
    seen_all_at = all_in["t"] + all_in["local"] + all_in["channel"] if all_in else None
    row = {
        "nodes": nodes, "ranks": world,
        "hang_named_after_onset_s": round(detected - onset, 3),
        "node0_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "report_after_decision_s": round(reported - detected, 2),
        "poll_s_median": round(median(healthy), 4),
        "poll_s_median_hung": round(median(poll_costs[len(healthy):]), 4),
        "store_bytes_total": store_bytes,
        "upload_bytes_per_node": int(median(uploads)),
        "planted_named": named,
        "decision": dog.result.decision.value,
        "evidence": dog.result.evidence,
        "finding": hang.summary if hang else None,
        "findings": [f"{f.kind}: {f.summary[:300]}" for f in result.findings],
        "last_node_published_after_onset_s": round(last_published - onset, 3) if last_published else None,
        "nodes_published_after_onset_s": _quantiles([p - onset for p in published_at]),
        "named_after_last_publish_s": round(detected - last_published, 3) if last_published else None,
        "node_poll_s_median": round(median(node_polls), 4),
        "node_poll_s_p90": round(sorted(node_polls)[int(0.9 * len(node_polls))], 4) if node_polls else None,
        "all_waiting_seen_after_onset_s": round(seen_all_at - onset, 3) if seen_all_at else None,
        "polls_after_onset": [{k: round(v, 4) for k, v in p.items() if k != "t"} | {"at": round(p["t"] - onset, 3)}
                              for p in after][:60],
        "nodes_torn_down_after_decision_s": _quantiles([t - detected for t, _ in ended]),
        "nodes_uploaded_after_decision_s": _quantiles([u - detected for _, u in ended]),
        "gather_s": round(gathered - detected, 2), "judge_s": round(judged - gathered, 2),
        "reports_s": round(reported - judged, 2),
        "verdict_read_by_every_node_s": round(verdict_read - judged, 2),
        "report_files_bytes": sizes,
        "timeline_open_s": browser_open_s(root / "reports" / "timeline.html"),
        "peak_rss_mib_by_phase": rss_at,
        "errors": errors[:5],
    }
    return row


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def browser_open_s(page: Path) -> dict[str, float] | None:
    """Seconds a headless Chromium takes to load and lay out ``page`` and hand back its DOM, and to do the
    same for an empty page (its own start); None where no Chromium is installed."""
    chromium = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if chromium is None:
        return None
    empty = page.parent / "empty.html"
    empty.write_text("<!doctype html><html><body></body></html>", encoding="utf-8")
    out = {}
    for name, path in (("empty_page", empty), ("timeline", page)):
        began = time.perf_counter()
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
        out[name] = round(time.perf_counter() - began, 2)
    empty.unlink()
    return out


def _quantiles(values: list[float]) -> dict[int, float] | None:
    """The 10th, 50th, 90th and 100th percentiles, in seconds."""
    values = sorted(values)
    return {q: round(values[int(q / 100 * (len(values) - 1))], 3) for q in (10, 50, 90, 100)} if values else None


def _peak_rss_mib() -> float:
    """Node 0's peak resident memory so far (the peak after each phase tells which phase set it)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _contiguous(items: list[int], parts: int) -> list[list[int]]:
    parts = max(1, min(parts, len(items)))
    size = -(-len(items) // parts)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _time_polls(dog: Any, costs: list[float], phases: list[dict[str, float]] | None = None) -> None:
    """How long each of node 0's polls takes (its ranks' files, the channel, the judgement), not its sleep;
    ``phases`` gets each poll's parts: when it began (wall time), its own ranks' files (``local``), the
    channel's publish and merge (``channel``), the judgement (``judge``) and how many ranks were waiting."""
    inner_poll, inner_observe = dog.monitor.poll, dog.detector.observe
    channel = dog.channel
    inner_everyone = channel.everyone
    began = [0.0, 0.0, 0.0, 0.0]

    def poll() -> Any:
        began[0], began[3] = time.perf_counter(), time.time()
        out = inner_poll()
        began[1] = time.perf_counter()
        return out

    def everyone(local: Any) -> Any:
        out = inner_everyone(local)
        began[2] = time.perf_counter()
        return out

    def observe(now: float, ranks: Any) -> Any:
        judge_from = time.perf_counter()
        decision = inner_observe(now, ranks)
        end = time.perf_counter()
        costs.append(end - began[0])
        if phases is not None:
            phases.append({"t": began[3], "local": began[1] - began[0], "channel": judge_from - began[1],
                           "judge": end - judge_from, "waiting": sum(1 for p in ranks.values() if p.waits)})
        return decision

    dog.monitor.poll, dog.detector.observe, channel.everyone = poll, observe, everyone


def write_reports(report: Any, files: Any, out: Path) -> dict[str, int]:
    """Every format node 0 writes, as the CLI writes them; their sizes in bytes."""
    from rich.console import Console

    from distcheck.files.trace_reader import read_trace_dir
    from distcheck.report import chrome_trace, html_timeline, json_report, junit, terminal

    out.mkdir(parents=True, exist_ok=True)
    events = {report.scenarios[0].name: {r: t.events for r, t in read_trace_dir(files.traces).items()}}
    texts = {"report.json": json_report.render(report), "junit.xml": junit.render(report),
             "trace.json": chrome_trace.render(report, events), "timeline.html": html_timeline.render(report, events)}
    with open(out / "terminal.txt", "w", encoding="utf-8") as f:
        terminal.render(report, Console(file=f, width=120, color_system=None))
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}


def run_row(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """Node 0 and the workers of simulated nodes as sibling processes (node 0's teardown ends its own
    descendants, as it does in a real run), around a store of the benchmark's own for its timing keys."""
    from torch.distributed import TCPStore

    rpn = args.ranks_per_node
    root = Path(tempfile.mkdtemp(prefix=f"distcheck-cluster-{nodes}-", dir=args.workdir))
    prefix, barrier = templates(nodes * rpn, args.records_per_rank // 2)
    (root / "tpl.prefix").write_bytes(prefix)
    (root / "tpl.barrier").write_bytes(barrier)
    bench_port, port = free_port(), free_port()
    bench = TCPStore("127.0.0.1", bench_port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=600))
    common = ["--nnodes", str(nodes), "--port", str(port), "--bench-port", str(bench_port), "--ranks-per-node",
              str(rpn), "--root", str(root), "--node-poll-s", str(args.node_poll_s), "--tpl-prefix",
              str(root / "tpl.prefix"), "--tpl-barrier", str(root / "tpl.barrier"), "--workers", str(args.workers),
              "--settle-s", str(args.settle_s), "--records-per-rank", str(args.records_per_rank)]
    out = root / "row.json"
    cmds = [[sys.executable, __file__, "--row", "--row-json", str(out), *common]]
    cmds += [[sys.executable, __file__, "--worker", "--first", str(c[0]), "--last", str(c[-1]), *common]
             for c in _contiguous(list(range(1, nodes)), args.workers)]
    procs = [subprocess.Popen(c, start_new_session=True) for c in cmds]
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    del bench
    try:
        row = json.loads(out.read_text())
    except (OSError, ValueError):
        row = {"nodes": nodes, "ranks": nodes * rpn, "error": f"exit {[p.returncode for p in procs]}"}
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return row


# -- the table -------------------------------------------------------------------------------------------

COLUMNS = ["nodes", "ranks", "hang_named_after_onset_s", "last_node_published_after_onset_s",
           "named_after_last_publish_s", "node0_peak_rss_mib", "report_after_decision_s", "poll_s_median",
           "poll_s_median_hung", "node_poll_s_median", "store_bytes_total", "upload_bytes_per_node", "planted_named"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,64,512")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--records-per-rank", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=4, help="processes the simulated nodes are spread over")
    p.add_argument("--node-poll-s", type=float, default=0.1, help="the simulated nodes' watchdog poll interval")
    p.add_argument("--settle-s", type=float, default=3.0, help="healthy polling before the hang is planted")
    p.add_argument("--json", type=Path)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the launch dirs and reports")
    # internal: one row (node 0), or one worker of simulated nodes
    p.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--nnodes", "--first", "--last", "--port", "--bench-port"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--root", "--tpl-prefix", "--tpl-barrier", "--row-json"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = parse_args(p, TINY)
    if args.worker:
        worker(args)
        return
    if args.row:
        import distcheck.launch.launcher  # noqa: F401
        Path(args.row_json).write_text(json.dumps(node0(args)))
        return
    rows = []
    cond = {"conditions": conditions(), "ranks_per_node": args.ranks_per_node,
            "records_per_rank": args.records_per_rank, "workers": args.workers, "node_poll_s": args.node_poll_s,
            "transport": "c10d TCPStore on loopback"}
    print(f"conditions: {cond}")
    for n in (int(x) for x in args.nodes.split(",")):
        t0 = time.time()
        row = run_row(args, n)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(table(COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows],
                title=f"Cluster scale: {args.ranks_per_node} ranks per node, {args.records_per_rank:,} records per rank"))
    if args.json:
        args.json.write_text(json.dumps({"conditions": cond, "rows": rows}, indent=1))
    well_formed({f"{r['nodes']} nodes": {k: r.get(k) for k in FIGURES} for r in rows},
                {f"{r['nodes']} nodes: the planted hang named, no node's error": r.get("planted_named") is True
                 and not r.get("errors") for r in rows})


if __name__ == "__main__":
    main()
