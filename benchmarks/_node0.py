"""Node 0 of ``cluster_scale``: distcheck's real code from the store to the report files, timed from outside
(a helper of ``cluster_scale``, not part of distcheck).

Node 0 hosts distcheck's ``ClusterStore`` and runs the real ``Watchdog`` with its ``LaunchChannel`` (liveness,
the merge of every node's progress, the wait-for graph), then the real post-launch path: its own upload,
``gather``, the merge of the node summaries, ``judged_across_nodes`` (collect + diagnose, as node 0 runs it)
and every report format.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import resource
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from _cluster_sim import LAUNCH, config, counted_channel, job, limits, stall_timeout
from _faults import named
from _mesh import SYNTHETIC_FILE
from _probe_sim import ProbeSim
from _reports import browser_open_s, write_reports
from _sim_ranks import STACK_EVERY_S, NodeRanks, spare_fds


def worker_chunks(nodes: int, workers: int, lost: int | None) -> list[list[int]]:
    """The simulated nodes of each worker process, contiguous; a node that will be lost in a worker of its own
    (killed at the onset, its machine gone)."""
    others = [n for n in range(1, nodes) if n != lost]
    parts = max(1, min(workers, len(others))) if others else 0
    size = -(-len(others) // parts) if parts else 0
    chunks = [others[i:i + size] for i in range(0, len(others), size)] if others else []
    return chunks + ([[lost]] if lost is not None else [])


def cpu_s() -> float:
    """Node 0's own CPU seconds so far (user and system, its threads included): its cost, whatever the load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 2)


def peak_rss_mib() -> float:
    """Node 0's peak resident memory so far (the peak after each phase tells which phase set it)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def stamped(channel: Any, counter: Any, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """When each of the channel's ``names`` started and ended, node 0's peak RSS then, and the store bytes it
    sent: the steps of the real judgment, timed from outside it."""
    steps: dict[str, dict[str, float]] = {}

    def timed(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = counter.bytes
            step = steps.setdefault(name, {"start": time.time(), "rss_start": peak_rss_mib(), "cpu_start": cpu_s()})
            try:
                return call(*args, **kwargs)
            finally:
                step.update(end=time.time(), rss_end=peak_rss_mib(), cpu_end=cpu_s(), bytes=counter.bytes - before)
        return wrapper

    for name in names:
        setattr(channel, name, timed(name, getattr(channel, name)))
    return steps


def time_polls(dog: Any, costs: list[float], phases: list[dict[str, float]], profile: Any = None) -> None:
    """How long each of node 0's polls takes (its ranks' files, the channel, the judgement), not its sleep;
    ``phases`` gets each poll's parts: when it began (wall time), its own ranks' files (``local``), the
    channel's publish and merge (``channel``), the judgement (``judge``), the poll's thread's own CPU (``cpu``:
    the rest of its wall time the poll waited for the core or the GIL) and how many ranks were waiting;
    ``profile`` (a ``cProfile.Profile``), where given, runs over every poll (its files, the channel, the judgement)."""
    inner_poll, inner_observe = dog.monitor.poll, dog.detector.observe
    channel = dog.role.channel
    inner_everyone = channel.everyone
    began = [0.0, 0.0, 0.0, 0.0, 0.0]

    def poll() -> Any:
        if profile is not None:
            profile.enable()
        began[0], began[3], began[4] = time.perf_counter(), time.time(), time.thread_time()
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
        if profile is not None:
            profile.disable()
        end = time.perf_counter()
        costs.append(end - began[0])
        phases.append({"t": began[3], "local": began[1] - began[0], "channel": judge_from - began[1],
                       "judge": end - judge_from, "cpu": time.thread_time() - began[4],
                       "waiting": sum(1 for p in ranks.values() if p.waits)})
        return decision

    dog.monitor.poll, dog.detector.observe, channel.everyone = poll, observe, everyone


class Node0:
    """One row: node 0's real code against ``args.nnodes - 1`` simulated nodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.distributed import TCPStore

        from distcheck.files.launch_dir import LaunchFiles
        from distcheck.launch.cluster import ClusterStore

        spare_fds()
        self.args = args
        self.mesh, self.model, templates, self.plan = job(args)
        self.rpn = args.ranks_per_node
        self.bench = TCPStore("127.0.0.1", args.bench_port, is_master=False, timeout=datetime.timedelta(seconds=900))
        self.cluster = ClusterStore(config(args.nnodes, 0, args.port))
        self.channel, self.counter = counted_channel(self.cluster, self.mesh.world)
        self.idle = subprocess.Popen(["sleep", "86400"])
        self.ranks = NodeRanks(LaunchFiles(Path(args.root) / "node0" / LAUNCH), 0, range(self.rpn), self.mesh,
                               self.model, templates, self.plan, self.idle.pid)
        self.files = self.ranks.files
        self.chunks = worker_chunks(args.nnodes, args.workers, self.plan.lost_node)
        self.reporting = [c[0] for c in self.chunks if c != [self.plan.lost_node]]   # workers that live to report
        self.poll_costs: list[float] = []
        self.phases: list[dict[str, float]] = []

    def run(self) -> dict[str, Any]:
        from distcheck.launch.watchdog import Watchdog

        self.ranks.write_healthy()
        probe = ProbeSim(self.ranks.where)
        probe.watch(self.files, self.ranks.ranks)
        probe.start()
        dog = Watchdog(self.files, self.mesh.world, limits(self.args, self.plan), channel=self.channel)
        self.poll_profile = cProfile.Profile() if self.args.profile else None
        time_polls(dog, self.poll_costs, self.phases, self.poll_profile)
        self.started = time.time()
        dog.start()
        deadline = time.monotonic() + 900
        while int(self.bench.add("bench/ready", 0)) < self.args.nnodes - 1:
            if time.monotonic() > deadline:
                raise SystemExit("the simulated nodes did not start")
            time.sleep(0.2)
        time.sleep(self.args.settle_s)                 # every node beating and publishing, node 0 polling
        healthy = len(self.poll_costs)
        onset_at = time.time() + 1.0
        self.bench.set("bench/onset_at", repr(onset_at))
        time.sleep(max(0.0, onset_at - time.time()))
        self.ranks.plant(onset_at)
        node0_done = time.time()
        if self.plan.straggler:
            time.sleep(max(0.0, onset_at + self.args.straggle_s - time.time()))
            self.ranks.resume(onset_at + self.args.straggle_s)
        while dog.is_alive() and not self.files.release.exists():
            dog.join(timeout=STACK_EVERY_S)
        dog.stop()
        dog.join()
        decided = time.time()
        if self.poll_profile is not None:
            Path(self.args.profile).mkdir(parents=True, exist_ok=True)
            self.poll_profile.dump_stats(str(Path(self.args.profile) / "polls.pstats"))
        planted = [float(self.bench.get(f"bench/planted/{first}")) for first in self.reporting]
        onset = max([node0_done, onset_at] + planted)
        detected = dog.result.detected_at
        # the decision's figures first, on their own: a row cut short later (its time limit, memory) still has them
        Path(self.args.row_json + ".decision").write_text(json.dumps({
            "hang_named_after_onset_s": round(detected - onset, 3) if detected else None,
            "decision": dog.result.decision.value, "evidence": dog.result.evidence,
            "node0_peak_rss_mib_at_decision": peak_rss_mib(), "node0_cpu_s_at_decision": cpu_s()}))
        return self._judged(dog, onset, decided, healthy)

    def _judged(self, dog: Any, onset: float, decided: float, healthy: int) -> dict[str, Any]:
        """The launch's end on node 0: the real judgment (targets.launching.judged_across_nodes), its steps timed
        where they cross the channel, then every report file."""
        from distcheck.launch.launcher import LaunchOutcome
        from distcheck.models import EndReason, Report
        from distcheck.options import RunOptions
        from distcheck.session import run_info
        from distcheck.targets.launching import judged_across_nodes
        from distcheck.targets.script import ScriptTarget

        detected = dog.result.detected_at or decided
        outcome = LaunchOutcome(dog.result.decision.end_reason or EndReason.COMPLETED, self.started, time.time(),
                                dog.result)
        rss_at, cpu_at = {"decided": peak_rss_mib()}, {"decided": cpu_s()}
        steps = stamped(self.channel, self.counter, ("upload", "gather", "post_result"))
        options = RunOptions(nproc_per_node=self.rpn, backend="gloo", stall_timeout=stall_timeout(self.args, self.plan),
                             nodes=config(self.args.nnodes, 0, self.args.port), run_dir=Path(self.args.root) / "run")
        target = ScriptTarget(name=LAUNCH, file=SYNTHETIC_FILE, expect=("hang",))
        with _profiled(self.args.profile, "judged"):
            result = judged_across_nodes(target, options, self.files.root, outcome, self.channel)
        rss_at["gathered"], rss_at["judged"] = steps["gather"]["rss_end"], steps["post_result"]["rss_start"]
        report = Report(run=run_info(options, self.files.root.parent, self.started), scenarios=(result,))
        reports = Path(self.args.root) / "reports"
        with _profiled(self.args.profile, "reports"):
            sizes = write_reports(report, self.files, reports)
        reported = time.time()
        rss_at["reported"], cpu_at["reported"] = peak_rss_mib(), cpu_s()
        cpu_at["gathered"], cpu_at["judged"] = steps["gather"]["cpu_end"], steps["post_result"]["cpu_start"]
        ok, said = named(self.plan, result, dog.result.decision.value, dog.result.evidence, list(self.channel.lost_nodes))
        row = {
            "hang_named_after_onset_s": round(detected - onset, 3) if dog.result.detected_at else None,
            "decision": dog.result.decision.value, "evidence": dog.result.evidence,
            "planted_named": ok, "first_hang": said,
            "findings": [f"{f.kind}: {f.summary[:300]}" for f in result.findings][:12],
            "findings_count": len(result.findings),
            "lost_nodes": list(self.channel.lost_nodes),
            "node0_peak_rss_mib": peak_rss_mib(), "peak_rss_mib_by_phase": rss_at, "node0_cpu_s_by_phase": cpu_at,
            "judge_cpu_s": round(cpu_at["judged"] - cpu_at["gathered"], 2),
            "reports_cpu_s": round(cpu_at["reported"] - cpu_at["judged"], 2),
            "load_at_report": [round(x, 2) for x in __import__("os").getloadavg()],
            "report_after_decision_s": round(reported - detected, 2),
            "gather_s": round(steps["gather"]["end"] - detected, 2),
            "judge_s": round(steps["post_result"]["start"] - steps["gather"]["end"], 2),
            "reports_s": round(reported - steps["post_result"]["start"], 2),
            "verdict_read_by_every_node_s": round(steps["post_result"]["end"] - steps["post_result"]["start"], 2),
            "report_files_bytes": sizes,
            "terminal_lines": len((reports / "terminal.txt").read_text().splitlines()),
            "timeline_open_s": browser_open_s(reports / "timeline.html") if self.args.browser else None,
            "poll_s_median": _median(self.poll_costs[:healthy]), "poll_s_median_hung": _median(self.poll_costs[healthy:]),
            "upload0": steps["upload"]["bytes"],
        }
        return row | self._from_workers(onset, detected)

    def _from_workers(self, onset: float, detected: float) -> dict[str, Any]:
        """What the workers measured of their nodes, and where the time from the onset to the decision went."""
        self.bench.wait([f"bench/errors/{first}" for first in self.reporting])
        store_bytes = self.counter.bytes + self.cluster.liveness.store.bytes + int(self.bench.add("bench/store_bytes", 0))
        uploads, errors, published, polls, ended, connect, changed = [], [], [], [], [], [], []
        for first in self.reporting:
            uploads += json.loads(self.bench.get(f"bench/uploads/{first}")).values()
            ended += json.loads(self.bench.get(f"bench/ended/{first}")).values()
            errors += json.loads(self.bench.get(f"bench/errors/{first}"))
            got = json.loads(self.bench.get(f"bench/published/{first}"))
            published += got["at"].values()
            # each node's last publish before the verdict: the one that completed what node 0 judged by (a node's
            # ranks may reach their waits over more than one publish)
            changed += [max(before) for every in got["every"].values() if (before := [t for t in every if t <= detected])]
            polls += got["polls"]
            connect += got["connect"]
        self.idle.kill()
        last = max(published) if published else None
        after = [p for p in self.phases if p["t"] + p["local"] + p["channel"] >= onset - 0.5]
        others = self.args.nnodes - 1 - (self.plan.lost_node is not None)
        return {
            "store_bytes_total": store_bytes, "upload_bytes_per_node": int(_median(uploads)) if uploads else 0,
            "last_node_published_after_onset_s": round(last - onset, 3) if last and len(published) >= others else None,
            "named_after_last_publish_s": round(detected - last, 3) if last else None,
            # node 0's own share from the publish that completed the job's state (the last before the verdict)
            "named_after_last_change_s": round(detected - max(changed), 3) if changed else None,
            "nodes_published_after_onset_s": _quantiles([p - onset for p in published]),
            "node_poll_s_median": _median(polls), "node_poll_s_p90": _quantiles(polls, (90,)),
            # a node's two connections to node 0's store; past 1 s, an attempt timed out and was tried again
            "store_connect_s": _quantiles(connect), "store_connects_over_1s": sum(c > 1.0 for c in connect),
            "polls_after_onset": [_poll_row(p, onset) for p in after][:40],
            "polls_before_decision": [_poll_row(p, onset) for p in after if p["t"] <= detected][-8:],
            "nodes_torn_down_after_decision_s": _quantiles([t - detected for t, _ in ended]),
            "nodes_uploaded_after_decision_s": _quantiles([u - detected for _, u in ended]),
            "errors": errors[:5],
        }


@contextlib.contextmanager
def _profiled(out: str | None, name: str) -> Iterator[None]:
    """``--profile DIR``: node 0's thread in this step, as ``DIR/<name>.pstats`` (the gather's waits included)."""
    if not out:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        Path(out).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(str(Path(out) / f"{name}.pstats"))


def _poll_row(poll: dict[str, float], onset: float) -> dict[str, float]:
    return {k: round(v, 4) for k, v in poll.items() if k != "t"} | {"at": round(poll["t"] - onset, 3)}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return round(values[len(values) // 2], 4) if values else float("nan")


def _quantiles(values: list[float], qs: tuple[int, ...] = (10, 50, 90, 100)) -> dict[int, float] | None:
    values = sorted(values)
    return {q: round(values[int(q / 100 * (len(values) - 1))], 3) for q in qs} if values else None
