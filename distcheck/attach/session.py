"""``distcheck attach``: find the job, read every rank a few times an interval apart, judge, save.

Nothing here writes to the job: stacks come through py-spy without pausing the ranks (``--nonblocking``);
only a rank whose Python thread waits inside torch's C++ (DDP's reducer, a backend's wait), or, on NCCL, sits at
one line outside every collective (a device sync below ``loss.item()`` shows in no Python frame), is read once
more with native frames, which pauses it for the unwind (bounded by a time-out, measured, reported)."""

from __future__ import annotations

import datetime
import secrets
import socket
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.attach import discover, flight
from distcheck.attach.judge import Judged, RankView, fr_joined, judge, unread
from distcheck.attach.nodes import Gathered, Meeting
from distcheck.attach.position import Position, Where, position
from distcheck.attach.read import (BACKENDS, DENIED_HINT, StackRead, backend_of, proc_state, read_stacks, reader,
                                   thread_names)
from distcheck.diagnose.verdict import Scenario, exit_code, run_info
from distcheck.files.run_dir import make_run_dir
from distcheck.files.run_home import runs_root
from distcheck.files.saved_runs import write_report
from distcheck.files.stacks import TORCH
from distcheck.errors import ExitCode, UsageError
from distcheck.launch.node_config import NodeConfig
from distcheck.launch.procs import ActivityMeter
from distcheck.launch.slurm import slurm_job
from distcheck.models import Report
from distcheck.text import rank_list

SCENARIO = "attach"
READERS = 8          # py-spy processes at once (each reads one rank)
NATIVE_S = 15.0      # a native read: py-spy loads libtorch's symbols first (4.8 s measured on a crowded node)


@dataclass(frozen=True)
class AttachOptions:
    pids: tuple[int, ...] = ()
    slurm_job: str | None = None
    samples: int = 3
    interval_s: float = 0.5
    run_dir: Path | None = None
    command: str = "distcheck attach"
    nodes: NodeConfig = NodeConfig()       # several nodes: one attach per node, node 0 judges


@dataclass(frozen=True)
class Attached:
    report: Report | None                  # None on a node other than 0 (node 0 judges)
    judged: Judged | None
    denied: tuple[int, ...] = ()           # ranks whose stacks this user may not read
    paused_s: dict[int, float] = field(default_factory=dict)   # rank -> time its native read held it
    node0: dict | None = None              # another node: node 0's verdict ({"code", "summary", "run_dir"})
    meeting: Meeting | None = None         # node 0 of several: where it tells the others its verdict
    missing_nodes: tuple[int, ...] = ()    # nodes whose attach never came
    unread: tuple[int, ...] = ()           # the job's ranks nobody read

    @property
    def undecided(self) -> str | None:
        """Why nothing is decided (ranks not read, and nothing found among the others): attach exits 3."""
        return self.judged.undecided if self.judged is not None else None

    @property
    def incomplete(self) -> str | None:
        """Why the verdict does not cover the whole job (denied reads, ranks not read), in one line."""
        if self.denied:
            return (f"the stacks of ranks {', '.join(map(str, self.denied))} could not be read (permission denied): "
                    f"{DENIED_HINT}")
        if self.unread:
            why = (f"node(s) {', '.join(map(str, self.missing_nodes))} never joined" if self.missing_nodes
                   else "no process of theirs here: they run on other nodes (run one distcheck attach per node: "
                        "--nnodes, --node-rank) or have exited")
            return f"{rank_list(self.unread)} {'was' if len(self.unread) == 1 else 'were'} not read ({why})"
        return None

    @property
    def exit_code(self) -> int:
        """distcheck attach's exit code: the report's, except that a verdict not reached, or one that does not cover
        the whole job and found nothing, is never a pass (3); another node exits with node 0's."""
        if self.report is None:
            return int((self.node0 or {}).get("code", ExitCode.LAUNCH_FAILED))
        code = exit_code(self.report)
        if self.undecided or (self.incomplete and code == ExitCode.OK):
            return int(ExitCode.LAUNCH_FAILED)
        return int(code)

    def tell_nodes(self) -> None:
        """Node 0 of several: the verdict and the exit code, for the other nodes' attach."""
        if self.meeting is None or self.report is None:
            return
        result = self.report.scenarios[0]
        first = next((f.summary for f in result.findings if f.severity == "error"), self.undecided)
        readers = tuple(n for n in range(1, self.meeting.config.nnodes) if n not in self.missing_nodes)
        self.meeting.post_verdict(self.exit_code, first or "no error found", self.report.run.run_dir, readers)


def sample(ranks: Sequence[discover.RankProc], samples: int, interval_s: float,
           read: Callable[..., StackRead] = read_stacks) -> tuple[dict[int, list[StackRead]], ActivityMeter]:
    """``samples`` non-blocking reads of every rank, ``interval_s`` apart, between two counter samples."""
    meter = ActivityMeter(interval_s=0.0)
    for r in ranks:
        meter.sample(r.rank, r.pid, time.monotonic())
    reads: dict[int, list[StackRead]] = {r.rank: [] for r in ranks}
    with ThreadPoolExecutor(max_workers=min(READERS, len(ranks))) as pool:
        for i in range(samples):
            due = time.monotonic() + interval_s
            last = i == samples - 1
            for r, got in zip(ranks, pool.map(lambda r: read(r.pid, with_locals=last), ranks)):  # noqa: B023 - map ends in this pass
                reads[r.rank].append(got)
            if not last:
                time.sleep(max(0.0, due - time.monotonic()))   # the interval between samples, not a wait on the job
    for r in ranks:
        meter.sample(r.rank, r.pid, time.monotonic())
    return reads, meter


def _in_torch_native(p: Position, read: StackRead) -> bool:
    """A rank whose main thread is in torch's code but in no Python collective: maybe a C++-issued one."""
    from distcheck.attach.position import frame_kind

    main = read.main()
    top = main.frames[0] if main and main.frames else None
    return p.kind == Where.OUTSIDE and top is not None and frame_kind(top.file) == TORCH


def wants_native(reads: Sequence[StackRead], on_device: bool) -> bool:
    """Whether a rank is read once with native frames: its main thread in torch's C++ outside any Python collective
    in every sample (DDP's reducer, a backend's wait); or, where its calls complete on the device (NCCL), at one
    Python stack outside every collective in every sample: a device sync below ``loss.item()`` or ``.cpu()`` shows
    in no Python frame."""
    seen = [(position(x), x) for x in reads]
    if all(_in_torch_native(p, x) for p, x in seen):
        return True
    return on_device and len(seen) > 1 and all(p.kind == Where.OUTSIDE for p, _ in seen) \
        and len({p.digest for p, _ in seen}) == 1


def attach(options: AttachOptions) -> Attached:
    """Judge the job the options name, as one ``Report`` saved in its run dir. Several nodes: this node's
    views go to node 0, which judges them all; another node gets node 0's verdict (``Attached.node0``)."""
    # The job first: whose it is, or that there are several, says more than how its stacks would be read.
    found = discover.find_jobs(options.pids or None, options.slurm_job or _slurm_default(options),
                               one_agent=options.nodes.multi)   # one attach per node: its own agent's ranks
    job = discover.one_job(found)
    reader()   # the install hint before reading anything
    meeting = _meet(options.nodes, job) if options.nodes.multi else None
    started = time.time()
    local, paused, denied = _views(job, options)
    if meeting is not None and not meeting.leader:
        meeting.send(local)
        return Attached(None, None, denied, paused, node0=meeting.verdict(options.nodes.rdzv_timeout + 60))
    gathered = meeting.gather(local, options.nodes.rdzv_timeout) if meeting else Gathered(local)
    notes = _notes(job, gathered, denied, paused, options)
    why = (f"the distcheck attach of node(s) {', '.join(map(str, gathered.missing))} never came"
           if gathered.missing else "no process of theirs on the nodes read: they run on other nodes, or have exited")
    scenario = Scenario(name=SCENARIO, source=job.key, description=f"attached to {job.key} "
                        f"({len(gathered.views)} of {job.world_size} ranks read, on {_nodes_read(gathered)}), "
                        "the job left running")
    judged = judge(gathered.views, job.world_size, scenario, started=started, ended=time.time(), notes=notes,
                   unread_why=why, unread_todo=DENIED_HINT.capitalize() + "." if denied else "")
    report = _report(judged, job, options, started, gathered.views)
    attached = Attached(report, judged, denied, paused, meeting=meeting, missing_nodes=gathered.missing,
                        unread=tuple(unread(gathered.views, job.world_size)))
    attached.tell_nodes()   # the other nodes wait for node 0's verdict before they exit
    return attached


def _views(job: discover.Job, options: AttachOptions) -> tuple[dict[int, RankView], dict[int, float], tuple[int, ...]]:
    """This node's ranks read: a view per rank, how long a native read held each, the ranks it may not read."""
    reads, meter = sample(job.ranks, max(2, options.samples), options.interval_s)
    dumps = {r.rank: flight.read_state(r.pid, r.rank, job.world_size, r.env) for r in job.ranks}
    # A native read stops its rank for a second or more (measured): not where the Flight Recorder already says
    # which call each rank has in flight (every rank here has a dump, and this one's holds its call), unless the
    # call waits on the device (NCCL): then only native frames tell a host blocked in a device sync from one at work.
    told = all(isinstance(d, flight.FrState) for d in dumps.values())
    on_device = {r.rank: "nccl" in backend_of(thread_names(r.pid)) or _device_dump(dumps[r.rank]) for r in job.ranks}
    paused = _native_reads([r for r in job.ranks if not (told and _host_call_known(dumps[r.rank]))], reads,
                           on_device)
    host, node = socket.gethostname(), options.nodes.node_rank
    views = {r.rank: RankView(r.rank, r.pid, tuple(position(x) for x in reads[r.rank]), meter.latest.get(r.rank),
                              proc_state(r.pid), host=host, node=node,
                              fr=d if isinstance(d := dumps[r.rank], flight.FrState) else None) for r in job.ranks}
    denied = tuple(sorted(r for r, rs in reads.items() if any(x.denied for x in rs)))
    return views, paused, denied


def _device_dump(dump: flight.FrState | str | None) -> bool:
    return isinstance(dump, flight.FrState) and dump.device


def _slurm_default(options: AttachOptions) -> str | None:
    """Under Slurm with no pid given, only the ranks of the Slurm job attach runs in (``srun --jobid J``)."""
    job = slurm_job()
    return job.job_id if job is not None and not options.pids else None


def _meet(config: NodeConfig, job: discover.Job) -> Meeting:
    """Node 0's store for this attach; never the job's own (its MASTER_PORT is refused)."""
    _, port = config.store_address
    taken = {r.env.get("MASTER_PORT") for r in job.ranks}
    if str(port) in taken:
        raise UsageError(f"distcheck attach's store port {port} is the job's own MASTER_PORT: attach never writes "
                         "to the job's store", "give another --rdzv-endpoint port (or --store-port)")
    return Meeting(config, lambda text: print(f"distcheck attach: {text}", file=sys.stderr, flush=True))


def _nodes_read(gathered: Gathered) -> str:
    nodes = sorted({v.node for v in gathered.views.values()})
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(map(str, nodes))}"


def _native_reads(ranks: Sequence[discover.RankProc], reads: dict[int, list[StackRead]],
                  device: dict[int, bool]) -> dict[int, float]:
    """One native read of each rank ``wants_native`` chooses: its last read is replaced by it. Returns how long
    each such read held its rank."""
    chosen = [r for r in ranks if wants_native(reads[r.rank], device.get(r.rank, False))]
    if not chosen:
        return {}
    with ThreadPoolExecutor(max_workers=min(READERS, len(chosen))) as pool:
        native = list(pool.map(lambda r: read_stacks(r.pid, native=True, with_locals=True, timeout_s=NATIVE_S),
                               chosen))
    out = {}
    for r, got in zip(chosen, native):
        if got.error is None:
            reads[r.rank][-1] = got
        out[r.rank] = got.took_s
    return out


def _notes(job: discover.Job, gathered: Gathered, denied: tuple[int, ...], paused: dict[int, float],
           options: AttachOptions) -> list[str]:
    notes = [f"evidence: {max(2, options.samples)} stack samples {options.interval_s:g} s apart (py-spy, "
             "non-blocking) and /proc counters (CPU, I/O, wake-ups of the main thread, state, wchan)"]
    dumps = sorted(r for r, v in gathered.views.items() if v.fr is not None)
    if dumps:
        joined = fr_joined(gathered.views)
        notes.append(f"Flight Recorder dumps ({flight.DUMP_PREFIX}) of {rank_list(dumps)} read"
                     + (", joined by sequence number" if joined else
                        ": not joined (every rank needs a dump that holds the call its stack waits in)"))
    if paused:
        worst = max(paused.values())
        notes.append(f"native frames read from {len(paused)} rank(s), each paused at most {worst * 1000:.0f} ms")
    if gathered.missing:
        notes.append(f"node(s) {', '.join(map(str, gathered.missing))} sent nothing within "
                     f"{options.nodes.rdzv_timeout:g} s: their distcheck attach never came")
    missing = unread(gathered.views, job.world_size)
    if missing:
        notes.append(f"{len(gathered.views)} of {job.world_size} ranks read: {rank_list(missing)} "
                     f"{'was' if len(missing) == 1 else 'were'} not (run one distcheck attach per node)")
    if denied:
        notes.append(f"stacks of ranks {', '.join(map(str, denied))} could not be read (permission denied): "
                     f"{DENIED_HINT}")
    return notes


def _report(judged: Judged, job: discover.Job, options: AttachOptions, started: float,
            views: dict[int, RankView]) -> Report:
    run_id = "attach-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    run_dir = make_run_dir(options.run_dir or runs_root() / run_id)
    info = run_info(backend=backend(views), world_size=job.world_size, nnodes=options.nodes.nnodes,
                    nproc_per_node=max(1, len(views) // options.nodes.nnodes),
                    torch_version="the job's", command=options.command, run_dir=str(run_dir), seed=0,
                    started=started, ended=time.time(), versions={})
    report = Report(run=info, scenarios=(judged.result,))
    write_report(run_dir, report)
    return report


def backend(views: dict[int, RankView]) -> str:
    """The job's backend, as its ranks' threads name it (``read.backend_of``); failing that, a native frame of
    ProcessGroupNCCL or ProcessGroupGloo in a stack read; "unknown" before any process group was created."""
    found = {b for v in views.values() for b in v.state.backend.split("+")}
    if found - {""}:
        return "+".join(b for b in BACKENDS if b in found)
    stacks = " ".join(p.stack for v in views.values() for p in v.positions)
    return "nccl" if "ProcessGroupNCCL" in stacks else "gloo" if "ProcessGroupGloo" in stacks else "unknown"


def _host_call_known(dump: flight.FrState | str | None) -> bool:
    """The rank's dump holds its call in flight, and that call does not wait on the device."""
    return isinstance(dump, flight.FrState) and dump.open is not None and not dump.device
