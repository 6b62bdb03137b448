"""The simulated nodes of ``cluster_scale``: a worker process runs many of them (a helper, not part of distcheck).

Each node is distcheck's real node-side code with its own store connections: ``ClusterStore`` (a client and its
heartbeat thread), a real ``Watchdog`` over its own launch dir (publishing its ranks' progress, following node
0's decision; the worker polls all its nodes' watchdogs from one thread, each through the watchdog's own
``poll_once``), then ``upload`` and ``result`` on the node's own thread. Its ranks are ``_sim_ranks.NodeRanks``.

A node's teardown runs on its own thread, as each node's does on a cluster: from the worker's one polling
thread, 128 teardowns ran one after another. The simulated ranks' stack probe is ``_probe_sim.ProbeSim``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _faults import LOST_NODE_STALL_TIMEOUT_S, Plan
from _mesh import Mesh, Model
from _mesh_traces import Template
from _probe_sim import ProbeSim
from _sim_ranks import STACK_EVERY_S, NodeRanks, spare_fds

LAUNCH = "bench"
# The simulated nodes' processes run at a lower priority than node 0's. On a cluster node 0 has a machine of
# its own, and the other nodes' polls and uploads never take its CPU; here they share two cores with it, and
# at 512 nodes their burst when the hang begins held node 0's poll off the cores for up to 0.4 s.
WORKER_NICE = 10


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


def config(nodes: int, node: int, port: int) -> Any:
    from distcheck.launch.node_config import NodeConfig

    return NodeConfig(nnodes=nodes, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port - 1}", rdzv_id="scale",
                      rdzv_timeout=600.0, store_port=port)


def stall_timeout(args: argparse.Namespace, plan: Plan) -> float:
    return max(args.stall_timeout, LOST_NODE_STALL_TIMEOUT_S) if plan.lost_node is not None else args.stall_timeout


def limits(args: argparse.Namespace, plan: Plan) -> Any:
    from distcheck.launch.watchdog import Limits

    return Limits(stall_timeout=stall_timeout(args, plan), startup_timeout=600.0)


def job(args: argparse.Namespace) -> tuple[Mesh, Model, dict[str, Template], Plan]:
    """The job the row simulates, as ``run_row`` wrote it: the mesh, the step model, the templates, the fault."""
    root = Path(args.root)
    spec = json.loads((root / "job.json").read_text())
    mesh, model = Mesh(**spec["mesh"]), Model(**spec["model"])
    templates = {name: Template.load(root / "tpl", name, mesh, int(name[5:].split(".")[0]))
                 for name in spec["templates"]}
    return mesh, model, templates, Plan(**json.loads((root / "plan.json").read_text()))


def _own_teardown(dog: Any) -> tuple[Any, list[Any]]:
    """The watchdog's teardown, taken out of its poll: the worker's one polling thread only notes that it is
    due, and the node's own thread runs it."""
    real, asked = dog._tear_down, []
    dog._tear_down = asked.append
    return real, asked


class Sim:
    """One worker's nodes and what it measures of them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.distributed import TCPStore

        from distcheck.files.launch_dir import LaunchFiles

        self.args = args
        self.home_cores = os.sched_getaffinity(0)   # off node 0's core (--node0-core)
        self.mesh, self.model, templates, self.plan = job(args)
        self.bench = TCPStore("127.0.0.1", args.bench_port, is_master=False, timeout=datetime.timedelta(seconds=900))
        self.mine = range(args.first, args.last + 1)
        rpn = args.ranks_per_node
        self.idle = {n: subprocess.Popen(["sleep", "86400"]) for n in self.mine}
        self.nodes = {n: NodeRanks(LaunchFiles(Path(args.root) / f"node{n}" / LAUNCH), n, range(n * rpn, (n + 1) * rpn),
                                   self.mesh, self.model, templates, self.plan, self.idle[n].pid) for n in self.mine}
        self.probe = ProbeSim(self._where)
        self.uploaded: dict[int, int] = {}
        self.ended: dict[int, tuple[float, float]] = {}   # node -> (its ranks torn down, its upload sent)
        self.errors: list[str] = []
        self.onset = float("inf")
        self.publishes: dict[int, list[float]] = {}   # node -> each of its publishes after the onset
        self.first_published: set[int] = set()    # nodes whose watchdog published its ranks once
        self.node_polls: list[float] = []
        self.watched: list[tuple[int, Any, threading.Event]] = []
        self.lock = threading.Lock()
        self.connect_lock = threading.Lock()
        self.connect_s: list[float] = []   # each node's connections to node 0's store (the store and its heartbeat's)

    def _where(self, rank: int) -> tuple[str | None, str]:
        return self.nodes[rank // self.args.ranks_per_node].where(rank)

    def node(self, n: int) -> None:
        from distcheck.launch.cluster import ClusterStore
        from distcheck.launch.launcher import LaunchOutcome, node_summary
        from distcheck.launch.watchdog import Watchdog
        from distcheck.models import EndReason

        try:
            # One node of this worker connects at a time: on a cluster each node's distcheck connects from a machine
            # of its own, and its one thread's quiet_native_stderr holds; 128 threads at once here starved node 0's
            # store of the CPU to accept them and raced each other's stderr.
            with self.connect_lock:
                began = time.monotonic()
                cluster = ClusterStore(config(self.args.nnodes, n, self.args.port))
                self.connect_s.append(time.monotonic() - began)
            channel, counter = counted_channel(cluster, self.mesh.world)
            files = self.nodes[n].files
            dog = Watchdog(files, self.mesh.world, limits(self.args, self.plan), poll_s=self.args.node_poll_s, channel=channel)
            self._timed(n, dog, channel)
            tear_down, asked = _own_teardown(dog)
            over = threading.Event()
            started = time.time()
            with self.lock:
                self.watched.append((n, dog, over))
            over.wait()
            if asked:   # this node's teardown, on its own thread (on a cluster each node tears down at once)
                self.probe.watch(files, self.nodes[n].ranks)
                tear_down(asked[0])
            outcome = LaunchOutcome(dog.result.decision.end_reason or EndReason.COMPLETED, started, time.time(),
                                    dog.result)
            before = counter.bytes
            channel.upload(files, node_summary(outcome))
            self.uploaded[n] = counter.bytes - before
            self.ended[n] = (dog.result.torn_down_at or time.time(), time.time())
            if self.args.node0_core and len(self.ended) == len(self.mine):
                on_cores(self.home_cores)
            channel.result(timeout_s=900)
            self.bench.add("bench/store_bytes", counter.bytes)
        except Exception as exc:   # the row says so instead of hanging
            self.errors.append(f"node {n}: {type(exc).__name__}: {exc}")

    def _timed(self, n: int, dog: Any, channel: Any) -> None:
        """Times the node's own polls, and when it first published its ranks after the onset."""
        inner_poll, inner_publish = dog.monitor.poll, channel.publish

        def poll() -> Any:
            t = time.perf_counter()
            out = inner_poll()
            self.node_polls.append(time.perf_counter() - t)
            return out

        def publish(progress: Any) -> None:
            before = channel._published
            inner_publish(progress)
            if progress:
                self.first_published.add(n)
            if channel._published is not before and time.time() > self.onset:
                self.publishes.setdefault(n, []).append(time.time())

        dog.monitor.poll, channel.publish = poll, publish

    def watch_all(self) -> None:
        """Every watchdog of this worker's nodes, each polled every ``--node-poll-s`` by its own ``poll_once``
        (what its thread would run), from this one thread: 128 watchdog threads per process spent the two
        cores switching between themselves. A node whose ranks node 0 released ends its watch, as its launcher
        does when they exit."""
        pending = len(self.mine)
        while pending:
            began = time.monotonic()
            with self.lock:
                current = list(self.watched)
            for n, dog, over in current:
                if not over.is_set() and (dog.poll_once() or self.nodes[n].files.release.exists()):
                    if pending == len(self.mine) and self.args.node0_core:
                        on_cores(set(range(os.cpu_count() or 1)))
                    over.set()
                    pending -= 1
            if len(current) < len(self.mine) or pending:
                time.sleep(max(0.0, self.args.node_poll_s - (time.monotonic() - began)))

    def run(self) -> None:
        for n in self.mine:
            self.nodes[n].write_healthy()
        self.probe.start()
        threads = [threading.Thread(target=self.node, args=(n,), daemon=True) for n in self.mine]
        for t in threads:
            t.start()
        threading.Thread(target=self.watch_all, daemon=True).start()
        # Ready once every node has published its ranks once: its store connections are up and its watchdog polls.
        while len(self.first_published) < len(self.mine) and not self.errors:
            time.sleep(0.05)
        self.bench.add("bench/ready", len(self.mine))
        self.bench.wait(["bench/onset_at"])
        self.onset = float(self.bench.get("bench/onset_at"))
        time.sleep(max(0.0, self.onset - time.time()))
        if self.plan.lost_node in self.mine:   # this node's machine goes: its distcheck and its ranks with it
            os.killpg(os.getpgrp(), signal.SIGKILL)
        for n in self.mine:
            self.nodes[n].plant(self.onset)
        self.bench.set(f"bench/planted/{self.args.first}", repr(time.time()))
        if self.plan.straggler:
            self._straggle()
        for t in threads:
            t.join()
        self._report()

    def _straggle(self) -> None:
        resume_at = self.onset + self.args.straggle_s
        while time.time() < resume_at:
            for n in self.mine:
                if n == self.plan.node:
                    self.nodes[n].stack_moved()
            time.sleep(min(STACK_EVERY_S, max(0.0, resume_at - time.time())))
        for n in self.mine:
            self.nodes[n].resume(resume_at)

    def _report(self) -> None:
        first = self.args.first
        self.bench.set(f"bench/uploads/{first}", json.dumps(self.uploaded))
        self.bench.set(f"bench/ended/{first}", json.dumps(self.ended))
        self.bench.set(f"bench/published/{first}", json.dumps({"at": {n: at[0] for n, at in self.publishes.items()},
                                                                "every": self.publishes,
                                                                "polls": self.node_polls[-2000:],
                                                                "connect": self.connect_s}))
        self.bench.set(f"bench/errors/{first}", json.dumps(self.errors))
        for proc in self.idle.values():
            proc.kill()
            proc.wait()


def on_cores(cores: set[int]) -> None:
    """``--node0-core``: this worker's threads on ``cores``. Node 0 decided (this worker's first node follows it)
    and its share of the decision is measured: the simulated nodes' teardowns and uploads take every core, as each
    node's does on a machine of its own (on the one core beside node 0's, 2,047 nodes' teardowns of a TP stall did
    not all upload within node 0's gather time-out, 660 s). Once its nodes uploaded, the worker goes back off node
    0's core, which then writes the report on a core of its own (beside the nodes' waits for the verdict, 2,047
    heartbeats a second, it judged at a tenth of a core: 44 s of CPU in 459 s)."""
    for thread in os.listdir("/proc/self/task"):   # each thread's own: a thread made later inherits its maker's
        try:
            os.sched_setaffinity(int(thread), cores)
        except OSError:
            pass   # a thread that ended since


def worker(args: argparse.Namespace) -> None:
    """Nodes ``args.first`` .. ``args.last`` of the job, each with distcheck's node-side code."""
    os.nice(WORKER_NICE)
    spare_fds()
    from distcheck.launch import procs

    sim = Sim(args)
    # On a cluster each node's distcheck is a process of its own, so its last-line ``kill_descendants`` reaches
    # only its own ranks; here the nodes share a worker process, so each idle process is kept out of that sweep
    # (``procs.keep``): the first node to tear down would otherwise end every sibling node's ranks.
    for proc in sim.idle.values():
        procs.keep(proc.pid)
    sim.run()
