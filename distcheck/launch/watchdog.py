"""Watching a running job: progress of every rank, stall and timeout decisions.

``StallDetector`` is pure (time is passed in), so its rules are tested on
synthetic observations in milliseconds. ``RankMonitor`` reads the launch files
incrementally; ``Watchdog`` is the thread that ties them to the processes.
"""

from __future__ import annotations

import enum
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from distcheck.launch import memory
from distcheck.launch import procs
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stacks import main_stack, parse_dumps, torch_dir, user_top
from distcheck.files.trace import TraceTail
from distcheck.models import EndReason, Phase

STARTED_PHASES = (Phase.RUNNING, Phase.FINISHED, Phase.ERROR)
# A rank using this much of a core is computing, not blocked: a Python loop uses ~1.0 (still ~0.3
# with 4 ranks busy on 2 cores), a rank asleep or blocked in a C call (or idle after finishing)
# ~0.0, distcheck's own sidecars < 0.02.
BUSY_CPU = 0.1


class Decision(enum.Enum):
    CONTINUE = "continue"
    RELEASE = "release"          # every rank finished: let them exit
    STALL = "stall"              # no progress while someone waits or died
    TIMEOUT = "timeout"          # the run's --timeout
    MAX_DURATION = "max_duration"  # the pre-flight window ended
    FAILED = "failed"            # the watchdog itself failed: end the job rather than hang

    @property
    def end_reason(self) -> EndReason | None:
        """How a launch this decision ended is reported (None: it did not end the launch by itself)."""
        return _END_REASONS.get(self)


_END_REASONS = {Decision.STALL: EndReason.STALL, Decision.TIMEOUT: EndReason.TIMEOUT,
                Decision.MAX_DURATION: EndReason.MAX_DURATION}


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

    @property
    def dead(self) -> bool:
        return not self.alive or self.phase == Phase.ERROR

    @property
    def late(self) -> bool:
        """Outside every collective and using the CPU: busy in user code, so it may yet arrive."""
        return (self.alive and self.phase == Phase.RUNNING and self.open_collectives == 0
                and self.cpu is not None and self.cpu >= BUSY_CPU)


@dataclass(frozen=True)
class Limits:
    stall_timeout: float = 10.0
    timeout: float | None = None
    max_duration: float | None = None
    startup_timeout: float = 120.0
    busy_timeout: float = 600.0     # how long to wait for a rank busy in user code while others wait


@dataclass
class StallDetector:
    """Decides, from successive observations, when a run must end and why."""

    world_size: int
    limits: Limits
    start: float
    last_progress: float = 0.0
    _last_state: tuple | None = None

    def __post_init__(self) -> None:
        self.last_progress = self.start

    def observe(self, now: float, ranks: dict[int, RankProgress]) -> Decision:
        state = tuple((r, p.records, p.phase, p.alive) for r, p in sorted(ranks.items()))
        if state != self._last_state:
            self._last_state = state
            self.last_progress = now
        if len(ranks) == self.world_size and all(p.phase == Phase.FINISHED and p.alive for p in ranks.values()):
            return Decision.RELEASE
        if self.limits.timeout is not None and now - self.start >= self.limits.timeout:
            return Decision.TIMEOUT
        if self.limits.max_duration is not None and now - self.start >= self.limits.max_duration:
            return Decision.MAX_DURATION
        idle = now - self.last_progress
        started = len(ranks) == self.world_size and all(p.phase in STARTED_PHASES or p.dead for p in ranks.values())
        if not started:
            # A slow start (torch import on an overloaded machine) is not a hang.
            if any(p.dead for p in ranks.values()):
                return Decision.STALL if idle >= min(self.limits.stall_timeout, 5.0) else Decision.CONTINUE
            return Decision.STALL if idle >= self.limits.startup_timeout else Decision.CONTINUE
        someone_waits = any(p.open_collectives > 0 and p.alive for p in ranks.values())
        someone_died = any(p.dead for p in ranks.values())
        if someone_died and idle >= min(self.limits.stall_timeout, 5.0):
            return Decision.STALL   # normally the agent tears down first; this is the backstop
        if someone_waits and idle >= self.limits.stall_timeout:
            # Late is not hung: while a rank computes outside the collectives, it may still arrive.
            if idle < self.limits.busy_timeout and any(p.late for p in ranks.values()):
                return Decision.CONTINUE
            return Decision.STALL
        return Decision.CONTINUE

    def waiting_for_late(self, now: float, ranks: Mapping[int, RankProgress]) -> list[int]:
        """Ranks distcheck is waiting for past the stall timeout because they are busy."""
        waits = any(p.open_collectives > 0 and p.alive for p in ranks.values())
        if not waits or now - self.last_progress < self.limits.stall_timeout:
            return []
        return sorted(r for r, p in ranks.items() if p.late)


class RankMonitor:
    """Reads each rank's status and the new part of its trace on every poll."""

    def __init__(self, files: LaunchFiles, world_size: int) -> None:
        self.files = files
        self.world_size = world_size
        self.tails = {r: TraceTail(files.trace(r)) for r in range(world_size)}
        self.status: dict[int, RankStatus] = {}
        self._rss: dict[int, tuple[int, int]] = {}   # rank -> (last, peak) resident bytes
        self._cpu = procs.CpuMeter()
        self.busy_at: dict[int, str] = {}             # rank -> where a stack sample found it busy

    def _sample_memory(self, rank: int, pid: int | None) -> tuple[int | None, int | None]:
        """Last and peak resident memory; a dead rank keeps what it was last seen using."""
        now = memory.resident_bytes(pid)
        if now:   # 0: a dying process whose memory the kernel already reclaimed
            _, peak = self._rss.get(rank, (0, 0))
            self._rss[rank] = (now, max(now, peak))
        return self._rss.get(rank, (None, None))

    def pids(self) -> dict[int, int]:
        return {r: s.pid for r, s in self.status.items() if s.pid}

    def poll(self) -> dict[int, RankProgress]:
        out: dict[int, RankProgress] = {}
        for rank in range(self.world_size):
            status = self.files.read_status(rank)
            if status is not None:
                self.status[rank] = status
            status = self.status.get(rank)
            tail = self.tails[rank].read()
            if status is None and tail.records == 0:
                continue
            call = tail.newest_open
            alive = procs.is_alive(status.pid) if status else True
            rss, peak = self._sample_memory(rank, status.pid if status and alive else None)
            cpu = self._cpu.cores(rank, status.pid if status and alive else None, time.monotonic())
            out[rank] = RankProgress(
                records=tail.records, open_collectives=len(tail.open),
                phase=status.phase if status else None, alive=alive,
                current=f"{call.op} #{call.seq} [group {call.group}]" if call else None,
                since=call.t_enter if call else None, label=call.label if call else None,
                rss_bytes=rss, peak_rss_bytes=peak, cpu=cpu, busy_at=self.busy_at.get(rank),
            )
        return out

    def sample_stacks(self, ranks: list[int]) -> None:
        """Where each of ``ranks`` is busy: a faulthandler sample (it works with the GIL held in C)."""
        pids = {r: pid for r, pid in self.pids().items() if r in ranks}
        procs.request_stacks(pids, self.files.stack_sample, wait_s=0.5, sig=signal.SIGUSR2)
        for rank in pids:
            where = busy_line(self.files.stack_sample(rank), self.status[rank].main_thread)
            if where:
                self.busy_at[rank] = where


def busy_line(path: Path, main_thread: int | None) -> str | None:
    """file:line:function of the user's innermost frame in the newest dump of ``path``."""
    try:
        dumps = parse_dumps(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    thread = main_stack(dumps[-1], main_thread) if dumps else None
    frame = user_top(thread.frames, torch_dir()) if thread else None
    return f"{frame.file}:{frame.line}:{frame.function}" if frame else None


class NodeChannel(Protocol):
    """Multi-node: how one node's watchdog shares progress and node 0's decision
    (``cluster.LaunchChannel`` implements it; None on a single node)."""

    @property
    def is_leader(self) -> bool: ...
    def publish(self, progress: Mapping[int, RankProgress]) -> None: ...
    def everyone(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]: ...
    def post_decision(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None: ...
    def decision(self) -> dict[str, Any] | None: ...


@dataclass
class WatchdogResult:
    decision: Decision = Decision.CONTINUE
    stall_onset: float | None = None     # wall time of the last progress before the stall
    detected_at: float | None = None     # wall time the decision was taken
    torn_down_at: float | None = None
    killed_ranks: tuple[int, ...] = ()   # ranks alive when distcheck ended the run
    error: str | None = None             # why the watchdog itself failed
    lost_node_0: bool = False            # multi-node: node 0's distcheck went away mid-launch
    last_progress: dict[int, RankProgress] = field(default_factory=dict)
    # (rank, wall time, file:line:function): where a late rank was busy while others waited
    busy_samples: list[tuple[int, float, str]] = field(default_factory=list)


class Watchdog(threading.Thread):
    """Polls the ranks of one launch; on a stall or a limit, takes stacks and tears down."""

    def __init__(
        self, files: LaunchFiles, world_size: int, limits: Limits, poll_s: float = 0.1,
        on_poll: Callable[[dict[int, RankProgress], float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        channel: NodeChannel | None = None,
    ) -> None:
        super().__init__(name="distcheck-watchdog", daemon=True)
        self.files = files
        self.channel = channel   # multi-node: cluster.LaunchChannel; None on a single node
        self.monitor = RankMonitor(files, world_size)
        self.clock = clock
        self.detector = StallDetector(world_size, limits, start=clock())
        self.poll_s = poll_s
        self.on_poll = on_poll
        self.result = WatchdogResult()
        self._stop_event = threading.Event()
        self._released = False

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            self._watch()
        except Exception as exc:   # a watchdog that dies silently would let the job hang forever
            self.result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # a store connection that drops is node 0's distcheck ending, not a bug of ours
            self.result.lost_node_0 = self.channel is not None and type(exc).__name__ == "DistNetworkError"
            self.result.decision = Decision.FAILED
            self.result.detected_at = time.time()
            self._tear_down({})

    def _watch(self) -> None:
        wall_offset = time.time() - self.clock()
        while not self._stop_event.is_set():
            progress = self.monitor.poll()
            if self.channel is not None:
                self.channel.publish(progress)
                progress = self.channel.everyone(progress)
            self.result.last_progress = progress
            now = self.clock()
            decision = self.detector.observe(now, progress)
            self._sample_late(now, progress)
            if self.on_poll is not None:
                self.on_poll(progress, now - self.detector.last_progress)
            if decision is Decision.RELEASE:
                if not self._released:
                    self.files.release.touch()
                    self._released = True
            elif self.channel is not None and not self.channel.is_leader:
                # Node 0 decides for the whole job, so every node tears down for the same reason.
                posted = self.channel.decision()
                if posted is not None:
                    self.result.decision = Decision(posted["decision"])
                    self.result.stall_onset = posted["stall_onset"]
                    self.result.detected_at = posted["detected_at"]
                    self._tear_down(progress)
                    return
            elif decision is not Decision.CONTINUE:
                self.result.decision = decision
                self.result.stall_onset = self.detector.last_progress + wall_offset
                self.result.detected_at = time.time()
                if self.channel is not None:
                    self.channel.post_decision(decision.value, self.result.stall_onset, self.result.detected_at)
                self._tear_down(progress)
                return
            self._stop_event.wait(self.poll_s)

    def _sample_late(self, now: float, progress: Mapping[int, RankProgress]) -> None:
        """Once per rank and wait: where a rank that others wait for is busy (for the live view and the report)."""
        waiting_for = self.detector.waiting_for_late(now, progress)
        for rank in [r for r in self.monitor.busy_at if r not in waiting_for]:
            del self.monitor.busy_at[rank]   # it arrived: a later wait for it is sampled again
        late = [r for r in waiting_for if r not in self.monitor.busy_at]
        if late:
            self.monitor.sample_stacks(late)
            self.result.busy_samples.extend((r, time.time(), self.monitor.busy_at[r])
                                            for r in late if r in self.monitor.busy_at)

    def _tear_down(self, progress: dict[int, RankProgress]) -> None:
        pids = self.monitor.pids()
        alive = tuple(sorted(r for r, pid in pids.items() if procs.is_alive(pid)))
        self.result.killed_ranks = alive
        self.files.flight_recorder_request.touch()   # served by ranks that run the Flight Recorder sidecar
        procs.request_stacks(pids, self.files.stacks)
        procs.wait_for_files([self.files.flight_recorder(r) for r in alive
                              if r in self.monitor.status and self.monitor.status[r].flight_recorder],
                             timeout_s=2.0)
        procs.terminate_tree([pid for pid in pids.values() if procs.is_alive(pid)])
        procs.kill_descendants()
        self.result.torn_down_at = time.time()
