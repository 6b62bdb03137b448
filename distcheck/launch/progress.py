"""What the watchdog knows of each rank at a poll (``RankProgress``), read by ``RankMonitor`` from the launch
files (status, trace tail) and from the rank's process (CPU of its tree, I/O, a stack that moved): the
evidence that a rank outside the collectives makes progress, and where a busy rank is (its busy stack)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stack_requests import StackKind
from distcheck.files.stacks import main_stack, read_dumps, torch_dir, user_top
from distcheck.files.trace_tail import TraceTail
from distcheck.launch import procs
from distcheck.models import Phase
from distcheck.text import size

# A rank using this much of a core is computing, not blocked: a Python loop uses ~1.0 (still ~0.3
# with 4 ranks busy on 2 cores), a rank asleep or blocked in a C call (or idle after finishing)
# ~0.0, distcheck's own sidecars < 0.02.
BUSY_CPU = 0.1
# A stack that changed this recently is progress.
STACK_MOVED_S = 1.5
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
    # The wait-for graph (launch.waitfor): (group, seq, members, signature) of each blocking call it is in,
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
        return not self.alive or self.phase == Phase.ERROR

    @property
    def finished(self) -> bool:
        """It will enter no collective the others wait in: its work ended, or (a shared launch) its part of the
        scenario they are in (the second of two pytest tests: a rank past it does not make rank 0's barrier
        an uncertain wait until the stall timeout)."""
        return self.alive and (self.phase == Phase.FINISHED or self.done_with_scenario)

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
            pid = status.pid if facts is not None and facts.alive else None
            rss, peak = self._sample_memory(rank, facts.rss_bytes if pid else None)
            now = time.monotonic()
            cpu = self._cpu.cores(rank, facts.cpu_seconds if pid else None, now)
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
        here = set()
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
        said, ages = [], []
        act = self._activity.latest.get(rank)
        if act is not None and now - act.at < STACK_MOVED_S:
            if act.cores >= BUSY_CPU:
                said.append(f"its processes used {act.cores:.1f} cores")
            if act.io_bytes:
                said.append(f"read or wrote {size(act.io_bytes)} in the last {act.span:.1f} s")
            if act.wakeups and not said:
                said.append(f"its main thread woke {act.wakeups} times in the last {act.span:.1f} s")
            ages += [now - act.at] if said else []
        moved_at = self._stacks.get(rank, (0, float("-inf")))[1]
        if now - moved_at < STACK_MOVED_S:
            said.append("its stack moved")
            ages.append(now - moved_at)
        return {"evidence": ", ".join(said), "evidence_age": min(ages)} if said else {}

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
    thread = main_stack(dumps[-1], main_thread) if dumps else None
    frame = user_top(thread.frames, torch_dir()) if thread else None
    return f"{frame.file}:{frame.line}:{frame.function}" if frame else None


