"""The torch.distributed jobs on this node, found in /proc: processes whose environment has RANK and
WORLD_SIZE. Ranks are one job when their rendezvous agrees (``rendezvous``: the endpoint, WORLD_SIZE, the
launcher's run id where it is not torchrun's default ``none``, the Slurm job and step); two ranks that claim
one rank number are two jobs. Given a pid (a rank's, or its launcher's), every sibling of its ranks on the node
is found too, by the same rendezvous, even once the launcher is gone (torchrun's agent starts each rank in a
session of its own: a SIGKILLed torchrun leaves them running with parent 1). Read-only: environ, the process
table, thread names; nothing is sent to a process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from distcheck.attach.foreign import Foreign, foreign, looks_distributed, no_job_error
from distcheck.errors import UsageError

DEFAULT_RUN_ID = "none"   # torchrun --rdzv-backend c10d without --rdzv-id: every such job has this run id
# What attach keeps of a rank's environment: how it was started and where its Flight Recorder dumps go.
_KEPT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "PET_RDZV_ENDPOINT",
         "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_FR_BUFFER_SIZE",
         "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass(frozen=True)
class RankProc:
    """One rank's process, as its environment and the process table describe it."""

    pid: int
    rank: int
    world_size: int
    env: Mapping[str, str]
    ppid: int = 0
    started: float = 0.0     # when its process started (seconds since the epoch)

    @property
    def job(self) -> tuple[str, ...]:
        return rendezvous(self.env)


@dataclass(frozen=True)
class Job:
    key: str                  # how the job is named to its user
    ranks: tuple[RankProc, ...]

    @property
    def world_size(self) -> int:
        return max(r.world_size for r in self.ranks)


@dataclass(frozen=True)
class Found:
    jobs: tuple[Job, ...]
    denied: tuple[Foreign, ...] = ()    # processes whose environment this user may not read
    asked: tuple[int, ...] = ()         # the pids the user gave (none: every process was looked at)


def endpoint(env: Mapping[str, str]) -> str:
    """Where the ranks rendezvous: MASTER_ADDR:MASTER_PORT, else the rendezvous endpoint torchrun was given."""
    if env.get("MASTER_ADDR") or env.get("MASTER_PORT"):
        return f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return env.get("PET_RDZV_ENDPOINT", "")


def rendezvous(env: Mapping[str, str]) -> tuple[str, ...]:
    """What every rank of one job agrees on. torchrun's default run id ``none`` names no job: two jobs started
    with ``--rdzv-backend c10d`` and no ``--rdzv-id`` share it."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    slurm = ".".join(env[k] for k in ("SLURM_JOB_ID", "SLURM_STEP_ID") if env.get(k))
    return endpoint(env), env.get("WORLD_SIZE", ""), "" if run_id == DEFAULT_RUN_ID else run_id, slurm


def job_name(env: Mapping[str, str]) -> str:
    """The most telling of the job's names: its run id, else its endpoint, else its Slurm job."""
    where, _, run_id, slurm = rendezvous(env)
    if run_id:
        return f"TORCHELASTIC_RUN_ID={run_id}"
    if where:
        return f"MASTER_ADDR:MASTER_PORT={where}" if env.get("MASTER_PORT") else f"rendezvous endpoint {where}"
    return f"SLURM_JOB_ID={slurm}" if slurm else "unnamed job"


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
        proc = psutil.Process(pid)
        ppid, started = proc.ppid(), proc.create_time()
    except (ValueError, psutil.Error):
        return None
    return RankProc(pid, rank, world, {k: env[k] for k in _KEPT if k in env}, ppid, started)


@dataclass(frozen=True)
class _Scan:
    ranks: tuple[RankProc, ...]          # every rank readable here, less the processes that inherited one's env
    denied: tuple[int, ...]              # processes whose environment could not be read


def _scan(slurm_job: str | None) -> _Scan:
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    ranks, denied = [], []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid in mine:
            continue
        try:
            found = _rank_of(pid, read_environ(pid))
        except PermissionError:
            denied.append(pid)
            continue
        if found and (slurm_job is None or found.env.get("SLURM_JOB_ID") == slurm_job):
            ranks.append(found)
    return _Scan(tuple(without_inherited(ranks)), tuple(denied))


def without_inherited(ranks: Sequence[RankProc]) -> list[RankProc]:
    """Less the processes whose parent is the same rank of the same job (a data-loader worker, a compile
    worker: they inherit its environment), which are not ranks of their own."""
    by_pid = {r.pid: r for r in ranks}
    return [r for r in ranks if not ((up := by_pid.get(r.ppid)) and up.rank == r.rank and up.job == r.job)]


def _tree(pids: Iterable[int]) -> list[int]:
    """The given processes and all below them (a launcher's ranks)."""
    out: list[int] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            out += [pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            raise UsageError(f"no process {pid}",
                             "give the pid of a rank or of its launcher (torchrun, srun)") from None
        except psutil.Error as exc:
            raise UsageError(f"cannot read process {pid}: {exc}", "run attach as the job's user or as root") from None
    return out


def siblings(seeds: Sequence[RankProc], every: Sequence[RankProc], one_agent: bool = False) -> list[RankProc]:
    """The seeds and every rank of their jobs on this node: the same rendezvous and a rank number no rank found so
    far claims; of two ranks claiming one number (a stale rank of an earlier run on the same port), the one started
    nearer the seed. ``one_agent``: only the seed's torchrun agent's ranks (its GROUP_RANK, the node it stands for:
    one attach per node, where two agents of a job share a machine)."""
    out = {s.pid: s for s in seeds}
    for s in seeds:
        claimed = {r.rank for r in out.values() if r.job == s.job}
        for r in sorted(every, key=lambda r: abs(r.started - s.started)):
            same = r.job == s.job and (not one_agent or r.env.get("GROUP_RANK") == s.env.get("GROUP_RANK"))
            if same and r.pid not in out and r.rank not in claimed:
                out[r.pid] = r
                claimed.add(r.rank)
    return list(out.values())


def group_jobs(ranks: Sequence[RankProc]) -> tuple[Job, ...]:
    """The ranks as jobs: one per rendezvous, split where two ranks claim one rank number."""
    by_rdzv: dict[tuple[str, ...], list[RankProc]] = {}
    for r in ranks:
        by_rdzv.setdefault(r.job, []).append(r)
    jobs = []
    for members in by_rdzv.values():
        parts = _apart(members)
        for part in parts:
            name = job_name(part[0].env) + (f" (started {_clock(part[0].started)})" if len(parts) > 1 else "")
            jobs.append(Job(name, tuple(sorted(part, key=lambda r: r.rank))))
    return tuple(sorted(jobs, key=lambda j: (j.key, j.ranks[0].pid)))


def _apart(members: Sequence[RankProc]) -> list[list[RankProc]]:
    """One rendezvous's ranks as jobs. Two ranks with one rank number are two jobs: in order of start, a rank
    joins the newest job of its launcher (its parent) that lacks its number, else starts one."""
    if len({r.rank for r in members}) == len(members):
        return [list(members)]
    parts: list[list[RankProc]] = []
    for r in sorted(members, key=lambda r: (r.started, r.pid)):
        part = next((p for p in reversed(parts) if p[0].ppid == r.ppid and r.rank not in {x.rank for x in p}), None)
        if part is None:
            parts.append([r])
        else:
            part.append(r)
    return parts


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def find_jobs(pids: Iterable[int] | None = None, slurm_job: str | None = None, one_agent: bool = False) -> Found:
    """The jobs on this node; given pids, the jobs of the ranks among them and below them, each whole (every
    sibling on the node, whether or not its launcher still lives; ``one_agent``: of the given ranks' agents)."""
    scan = _scan(slurm_job)
    if pids is None:
        return Found(group_jobs(scan.ranks), tuple(f for f in map(foreign, scan.denied) if f and looks_distributed(f)))
    asked = tuple(pids)
    tree = set(_tree(asked))
    seeds = [r for r in scan.ranks if r.pid in tree]
    denied = tuple(f for pid in sorted(tree & set(scan.denied)) if (f := foreign(pid)))
    return Found(group_jobs(siblings(seeds, scan.ranks, one_agent)), denied, asked)


def one_job(found: Found) -> Job:
    """The one job to judge; an error listing them when there are several, or saying why there is none (a
    process of another user's is named, with what to do)."""
    if len(found.jobs) == 1:
        return found.jobs[0]
    if not found.jobs:
        raise no_job_error(found.denied, found.asked)
    listed = "; ".join(f"{j.key}: {len(j.ranks)} ranks (pids {', '.join(str(r.pid) for r in j.ranks[:4])}"
                       f"{', ...' if len(j.ranks) > 4 else ''})" for j in found.jobs)
    raise UsageError(f"{len(found.jobs)} torch.distributed jobs on this node: {listed}",
                     "name one: distcheck attach PID (a rank's or its launcher's) or --job SLURM_JOB_ID")
