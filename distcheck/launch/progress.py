"""What the watchdog knows of each rank at a poll (``RankProgress``), read by ``RankMonitor`` from the launch
files (status, trace tail) and from the rank's process (CPU of its tree, I/O, a stack that moved): the
signs that a rank outside the collectives makes progress (what counts as progress is ``diagnose.progress``),
and where a busy rank is (its busy stack)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.diagnose.progress import RECENT_S, Signs, progress
from distcheck.diagnose.where import stack_top
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stack_requests import StackKind
from distcheck.files.stacks import read_dumps, torch_dir
from distcheck.files.trace_tail import TraceTail
from distcheck.launch import procs
from distcheck.models import Phase

# Past this many ranks, a node's monitor lists its launch dir for the ranks it has instead of trying each rank.
SCAN_RANKS_ABOVE = 64


@dataclass(frozen=True)
class RankProgress:
    records: int = 0             # trace records written so far
    open_collectives: int = 0
    phase: Phase | None = None   # None until the rank wrote its status (a str from another node)
    alive: bool = True
    current: str | None = None   # "all_reduce #12 [group 0]" while inside a collective
    since: float | None = None   # wall time the current collective started
    label: str | None = None     # entry point of the current collective ("BinaryAUROC.compute")
    rss_bytes: int | None = None       # resident memory when last seen alive
    peak_rss_bytes: int | None = None  # the most it was seen using
    cpu: float | None = None           # CPU it used lately, in cores (None: not measured yet)
    busy_at: str | None = None         # file:line:function it was busy at while others waited (a stack sample)
    # The wait-for graph (diagnose.waitfor): (group, seq, members, signature) of each blocking call it is in,
    # the highest seq it entered per group, and whether its record is settled (synced after its newest record).
    waits: tuple = ()
    entered: Mapping[str, int] = field(default_factory=dict)
    left: tuple = ()             # (group, seq, signature) of the newest blocking calls it left
    settled: bool = False
    # Progress outside the collectives, in words ("read or wrote 41.0 KiB in the last 0.5 s"), and how many seconds ago
    # it was seen; None: none seen lately.
    evidence: str | None = None
    evidence_age: float = 0.0
    # A shared launch: its part of the scenario running now is over (it waits for the others at the scenario's
    # end, through the store); it enters none of that scenario's collectives again.
    done_with_scenario: bool = False

    @property
    def dead(self) -> bool:
        """It failed, or its process is gone without saying it finished (a rank of a command that finished its
        work, destroyed its group and exited is finished, not dead: its peers may idle on as long as they like)."""
        return self.phase == Phase.ERROR or (not self.alive and self.phase != Phase.FINISHED)

    @property
    def finished(self) -> bool:
        """It will enter no collective the others wait in: its work ended (its process may have exited since), or
        (a shared launch) its part of the scenario they are in (the second of two pytest tests: a rank past it does
        not make rank 0's barrier an uncertain wait until the stall timeout)."""
        return self.phase == Phase.FINISHED or (self.alive and self.done_with_scenario)

    @property
    def outside(self) -> bool:
        """Running user code, in no collective."""
        return self.alive and self.phase == Phase.RUNNING and self.open_collectives == 0

    @property
    def late(self) -> bool:
        """Outside every collective and making progress (CPU of its tree, I/O, a moving stack): it may yet arrive."""
        return self.outside and self.evidence is not None



class RankMonitor:
    """Reads each rank's status and the new part of its trace on every poll."""

    def __init__(self, files: LaunchFiles, world_size: int) -> None:
        self.files = files
        self.world_size = world_size
        self._scan_ranks = world_size > SCAN_RANKS_ABOVE
        # A large job's tails are made as their ranks show up here: a node holds a few of the world's ranks.
        self.tails = {} if self._scan_ranks else {r: TraceTail(files.trace(r)) for r in range(world_size)}
        self.status: dict[int, RankStatus] = {}
        self._status_keys: dict[int, tuple[int, int, int]] = {}   # rank -> (inode, mtime, size) of the status read
        self._status_paths: dict[int, Path] = {}
        self._rss: dict[int, tuple[int, int]] = {}   # rank -> (last, peak) resident bytes
        self._cpu = procs.CpuMeter()
        self._activity = procs.ActivityMeter()
        self._stacks: dict[int, tuple[int, float]] = {}   # rank -> (main-stack digest, when it last changed)
        self.busy_at: dict[int, str] = {}             # rank -> where a stack sample found it busy

    def _sample_memory(self, rank: int, now: int | None) -> tuple[int | None, int | None]:
        """Last and peak resident memory, given what it uses ``now``; a dead rank keeps what it was last
        seen using."""
        if now:   # 0: a dying process whose memory the kernel already reclaimed
            _, peak = self._rss.get(rank, (0, 0))
            self._rss[rank] = (now, max(now, peak))
        return self._rss.get(rank, (None, None))

    def pids(self) -> dict[int, int]:
        return {r: s.pid for r, s in self.status.items() if s.pid}

    def poll(self) -> dict[int, RankProgress]:
        out: dict[int, RankProgress] = {}
        for rank in self._ranks_here():
            status = self._read_status(rank)
            if rank not in self.tails:
                self.tails[rank] = TraceTail(self.files.trace(rank))
            tail = self.tails[rank].read()
            if status is None and tail.records == 0:
                continue
            call = tail.newest_open
            facts = procs.stat_of(status.pid) if status and status.pid else None
            alive = facts.alive if facts is not None else status is None   # no status yet: taken as starting
            pid = status.pid if status is not None and facts is not None and facts.alive else None
            rss, peak = self._sample_memory(rank, facts.rss_bytes if pid and facts is not None else None)
            now = time.monotonic()
            cpu = self._cpu.cores(rank, facts.cpu_seconds if pid and facts is not None else None, now)
            opened = tail.open.values()
            out[rank] = RankProgress(
                records=tail.records, open_collectives=len(opened),
                phase=status.phase if status else None, alive=alive,
                current=f"{call.op} #{call.seq} [group {call.group}]" if call else None,
                since=call.t_enter if call else None, label=call.label if call else None,
                rss_bytes=rss, peak_rss_bytes=peak, cpu=cpu, busy_at=self.busy_at.get(rank),
                waits=tuple((c.group, c.seq, c.members, c.signature) for c in opened),
                entered=dict(tail.entered), settled=tail.settled,
                left=tail.left_calls, done_with_scenario=not opened and status is not None and status.done_with_current,
                **self._evidence(rank, pid, tail.stack_digest, now, outside=not opened),
            )
        return out

    def _read_status(self, rank: int) -> RankStatus | None:
        """The rank's newest status, read again only when its file changed (each write replaces it)."""
        path = self._status_paths.get(rank)
        if path is None:
            path = self._status_paths[rank] = self.files.status(rank)
        try:
            st = os.stat(path)
        except OSError:
            return self.status.get(rank)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._status_keys.get(rank) != key:
            status = self.files.read_status(rank)
            if status is not None:
                self.status[rank] = status
                self._status_keys[rank] = key
        return self.status.get(rank)

    def _ranks_here(self) -> Iterable[int]:
        """The ranks to read: in a large job, those that left a status or a trace in this node's launch dir
        (two directory listings, where 4,096 ranks were 8,192 file opens per poll for a node's 8)."""
        if not self._scan_ranks:
            return range(self.world_size)
        here: set[int] = set()
        for folder, suffix in ((self.files.root / "status", ".json"), (self.files.traces, ".trace")):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            here.update(int(n[4:-len(suffix)]) for n in names
                        if n.startswith("rank") and n.endswith(suffix) and n[4:-len(suffix)].isdigit())
        return sorted(r for r in here if r < self.world_size)

    def _evidence(self, rank: int, pid: int | None, digest: int | None, now: float, outside: bool) -> dict:
        """What shows the rank making progress outside the collectives (``evidence``, in words) and how
        long ago it was seen (``evidence_age``); nothing when nothing does."""
        if outside:
            self._activity.sample(rank, pid, now)
        else:
            self._activity.forget(rank)
        if digest is not None:
            old = self._stacks.get(rank)
            if old is None or old[0] != digest:
                self._stacks[rank] = (digest, now if old is not None else float("-inf"))
        if not outside:
            return {}
        ages = []
        act = self._activity.latest.get(rank)
        if act is not None and now - act.at < RECENT_S:
            counted = act.signs()
            ages += [now - act.at] if progress(counted, keeps_watching=True) else []
        else:
            counted = Signs()
        moved_at = self._stacks.get(rank, (0, float("-inf")))[1]
        moved = now - moved_at < RECENT_S
        ages += [now - moved_at] if moved else []
        said = progress(dataclasses.replace(counted, stack_moved=moved), keeps_watching=True)
        return {"evidence": said, "evidence_age": min(ages)} if said else {}

    def busy_stacks(self, ranks: list[int]) -> None:
        """Where each of ``ranks`` is busy: a sample from its stack probe (py-spy where the GIL is held in C)."""
        pids = {r: pid for r, pid in self.pids().items() if r in ranks}
        procs.request_stacks(self.files, pids, StackKind.BUSY, wait_s=0.5)
        for rank, pid in pids.items():
            self._activity.rebaseline(rank, pid, time.monotonic())   # the dump it just wrote is ours, not progress
            where = busy_line(self.files.busy_stack(rank), self.status[rank].main_thread)
            if where:
                self.busy_at[rank] = where


def busy_line(path: Path, main_thread: int | None) -> str | None:
    """file:line:function of the user's innermost frame in the newest dump of ``path``."""
    dumps = read_dumps(path)
    return stack_top(dumps[-1], main_thread, torch_dir(), pool_idle=False) if dumps else None


