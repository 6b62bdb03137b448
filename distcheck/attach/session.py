"""``distcheck attach``: find the job, read every rank a few times an interval apart, judge, save.

Nothing here writes to the job: stacks come through py-spy without pausing the ranks (``--nonblocking``);
only a rank whose Python thread waits inside torch's C++ (DDP's reducer, a backend's wait) is read once
more with native frames, which pauses it for the unwind (bounded by a time-out, measured, reported)."""

from __future__ import annotations

import datetime
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from distcheck.attach import discover
from distcheck.attach.judge import Judged, RankView, judge
from distcheck.attach.position import Position, position
from distcheck.attach.read import DENIED_HINT, StackRead, proc_state, read_stacks, reader
from distcheck.diagnose.verdict import Scenario, run_info
from distcheck.files.launch_dir import write_json_atomic
from distcheck.files.run_dir import make_run_dir
from distcheck.files.saved_runs import REPORT_FILE
from distcheck.files.stacks import TORCH
from distcheck.launch.procs import ActivityMeter
from distcheck.models import Report

SCENARIO = "attach"
READERS = 8          # py-spy processes at once (each reads one rank)


@dataclass(frozen=True)
class AttachOptions:
    pids: tuple[int, ...] = ()
    slurm_job: str | None = None
    samples: int = 3
    interval_s: float = 0.5
    run_dir: Path | None = None
    command: str = "distcheck attach"


@dataclass(frozen=True)
class Attached:
    report: Report
    judged: Judged
    denied: tuple[int, ...] = ()           # ranks whose stacks this user may not read
    paused_s: dict[int, float] = field(default_factory=dict)   # rank -> time its native read held it


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
            for r, got in zip(ranks, pool.map(lambda r: read(r.pid, with_locals=last), ranks)):
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
    return p.kind == "outside" and top is not None and frame_kind(top.file) == TORCH


def attach(options: AttachOptions) -> Attached:
    """Judge the job the options name, as one ``Report`` saved in its run dir."""
    reader()   # the install hint before anything else
    job = discover.one_job(discover.find_jobs(options.pids or None, options.slurm_job))
    started = time.time()
    reads, meter = sample(job.ranks, max(2, options.samples), options.interval_s)
    paused = _native_reads(job.ranks, reads)
    views = {r.rank: RankView(r.rank, r.pid, tuple(position(x) for x in reads[r.rank]), meter.latest.get(r.rank),
                              proc_state(r.pid), host=socket.gethostname()) for r in job.ranks}
    denied = tuple(sorted(r for r, rs in reads.items() if any(x.denied for x in rs)))
    notes = _notes(job, denied, paused, options)
    scenario = Scenario(name=SCENARIO, source=job.key, description=f"attached to {job.key} "
                        f"({len(job.ranks)} of {job.world_size} ranks on this node), the job left running")
    judged = judge(views, job.world_size, scenario, started=started, ended=time.time(), notes=notes)
    report = _report(judged, job, options, started)
    return Attached(report, judged, denied, paused)


def _native_reads(ranks: Sequence[discover.RankProc], reads: dict[int, list[StackRead]]) -> dict[int, float]:
    """One native read of each rank seen in torch's C++ outside a Python collective in every sample (DDP's
    reducer, an NCCL wait): its last read is replaced by it. Returns how long each such read held its rank."""
    chosen = [r for r in ranks if all(_in_torch_native(position(x), x) for x in reads[r.rank])]
    if not chosen:
        return {}
    with ThreadPoolExecutor(max_workers=min(READERS, len(chosen))) as pool:
        native = list(pool.map(lambda r: read_stacks(r.pid, native=True, with_locals=True), chosen))
    out = {}
    for r, got in zip(chosen, native):
        if got.error is None:
            reads[r.rank][-1] = got
        out[r.rank] = got.took_s
    return out


def _notes(job: discover.Job, denied: tuple[int, ...], paused: dict[int, float], options: AttachOptions) -> list[str]:
    notes = [f"evidence: {max(2, options.samples)} stack samples {options.interval_s:g} s apart (py-spy, "
             "non-blocking) and /proc counters (CPU, I/O, wake-ups of the main thread, state, wchan)"]
    if paused:
        worst = max(paused.values())
        notes.append(f"native frames read from {len(paused)} rank(s), each paused at most {worst * 1000:.0f} ms")
    if len(job.ranks) < job.world_size:
        notes.append(f"only {len(job.ranks)} of {job.world_size} ranks run on this node: the others were not read")
    if denied:
        notes.append(f"stacks of ranks {', '.join(map(str, denied))} could not be read (permission denied): "
                     f"{DENIED_HINT}")
    return notes


def _report(judged: Judged, job: discover.Job, options: AttachOptions, started: float) -> Report:
    run_id = "attach-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    run_dir = make_run_dir(options.run_dir or Path(".distcheck") / "runs" / run_id)
    backend = _backend(judged)
    info = run_info(backend=backend, world_size=job.world_size, nnodes=1, nproc_per_node=len(job.ranks),
                    torch_version="the job's", command=options.command, run_dir=str(run_dir), seed=0,
                    started=started, ended=time.time(), versions={})
    report = Report(run=info, scenarios=(judged.result,))
    write_json_atomic(run_dir / REPORT_FILE, report.to_dict())
    return report


def _backend(judged: Judged) -> str:
    stacks = " ".join(r.stack or "" for r in judged.result.ranks)
    return "nccl" if "NCCL" in stacks else "gloo" if "Gloo" in stacks or "gloo" in stacks else "unknown"
