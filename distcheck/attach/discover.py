"""The torch.distributed jobs on this node, found in /proc: processes whose environment has RANK and
WORLD_SIZE, grouped into jobs by TORCHELASTIC_RUN_ID, MASTER_ADDR:MASTER_PORT or SLURM_JOB_ID. Read-only:
environ and the process table, nothing is sent to a process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import psutil

from distcheck.errors import UsageError

# What a job's ranks share in their environment, most specific first.
_JOB_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR:MASTER_PORT", "SLURM_JOB_ID")
# What attach keeps of a rank's environment: how it was started and where its Flight Recorder dumps go.
_KEPT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "SLURM_JOB_ID", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass(frozen=True)
class RankProc:
    """One rank's process, as its environment describes it."""

    pid: int
    rank: int
    world_size: int
    env: Mapping[str, str]

    @property
    def job(self) -> str:
        return job_key(self.env)


@dataclass(frozen=True)
class Job:
    key: str
    ranks: tuple[RankProc, ...]

    @property
    def world_size(self) -> int:
        return max(r.world_size for r in self.ranks)


@dataclass(frozen=True)
class Found:
    jobs: tuple[Job, ...]
    denied: tuple[int, ...] = ()      # processes whose environment this user may not read


def job_key(env: Mapping[str, str]) -> str:
    for key in _JOB_KEYS:
        value = ":".join(env.get(k, "") for k in key.split(":"))
        if value.strip(":"):
            return f"{key}={value}"
    return "unnamed job"


def read_environ(pid: int) -> dict[str, str] | None:
    """A process's start-up environment (None: gone); PermissionError when it is not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _rank_of(pid: int, env: Mapping[str, str] | None) -> RankProc | None:
    if not env or not {"RANK", "WORLD_SIZE"} <= env.keys():
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        return None
    return RankProc(pid, rank, world, {k: env[k] for k in _KEPT if k in env})


def _candidates(pids: Iterable[int] | None) -> list[int]:
    """Every process (no pids given), else the given ones and all below them (a launcher's ranks)."""
    if pids is None:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    out: list[int] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            out += [pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            raise UsageError(f"no process {pid}", "give the pid of a rank or of its launcher (torchrun, srun)") from None
        except psutil.Error as exc:
            raise UsageError(f"cannot read process {pid}: {exc}", "run attach as the job's user or as root") from None
    return out


def find_jobs(pids: Iterable[int] | None = None, slurm_job: str | None = None) -> Found:
    """The jobs among the candidate processes. A process whose parent is the same rank of the same job (a
    data-loader worker, a compile worker: they inherit the environment) is not a rank of its own."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    ranks: dict[int, RankProc] = {}
    denied = []
    for pid in dict.fromkeys(_candidates(pids)):
        if pid in mine:
            continue
        try:
            found = _rank_of(pid, read_environ(pid))
        except PermissionError:
            denied.append(pid)
            continue
        if found and (slurm_job is None or found.env.get("SLURM_JOB_ID") == slurm_job):
            ranks[pid] = found
    ranks = {pid: r for pid, r in ranks.items() if not _inherited(r, ranks)}
    by_job: dict[str, list[RankProc]] = {}
    for r in ranks.values():
        by_job.setdefault(r.job, []).append(r)
    jobs = tuple(Job(k, tuple(sorted(rs, key=lambda r: r.rank))) for k, rs in sorted(by_job.items()))
    return Found(jobs, tuple(denied) if pids is None else ())


def _inherited(r: RankProc, ranks: Mapping[int, RankProc]) -> bool:
    try:
        parent = psutil.Process(r.pid).ppid()
    except psutil.Error:
        return False
    above = ranks.get(parent)
    return above is not None and above.rank == r.rank and above.job == r.job


def one_job(found: Found) -> Job:
    """The one job to judge; a usage error listing them when there are several, or saying why none."""
    if len(found.jobs) == 1:
        return found.jobs[0]
    if not found.jobs:
        why = (f"; the environment of {len(found.denied)} processes could not be read (not this user's)"
               if found.denied else "")
        raise UsageError(f"no torch.distributed job found on this node (no process with RANK and WORLD_SIZE){why}",
                         "give the ranks' or their launcher's pid, or run attach as the job's user or root")
    listed = "; ".join(f"{j.key}: {len(j.ranks)} ranks (pids {', '.join(str(r.pid) for r in j.ranks[:4])}"
                       f"{', ...' if len(j.ranks) > 4 else ''})" for j in found.jobs)
    raise UsageError(f"{len(found.jobs)} torch.distributed jobs on this node: {listed}",
                     "name one: distcheck attach PID (a rank's or its launcher's) or --job SLURM_JOB_ID")
