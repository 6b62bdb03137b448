"""Watching a running job: progress of every rank, stall and timeout decisions.

``StallDetector`` is pure (time is passed in), so its rules are tested on
synthetic observations in milliseconds. ``progress.RankMonitor`` reads the launch files
incrementally; ``Watchdog`` is the thread that ties them to the processes.
"""

from __future__ import annotations

import enum
import operator
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from distcheck import interrupt
from distcheck.launch import procs
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stack_requests import StackKind
from distcheck.launch.node_role import NodeChannel, node_role
from distcheck.launch.progress import RankMonitor, RankProgress
from distcheck.diagnose.waitfor import CertainHang, certain_hang
from distcheck.models import EndReason, Phase
from distcheck.text import rank_list

STARTED_PHASES = (Phase.RUNNING, Phase.FINISHED, Phase.ERROR)
# How long a stall verdict waits for a rank's sidecar to sync its record (a C++-issued call it made may be
# missing until then): on a loaded node the sidecar thread can be descheduled for seconds.
SYNC_GRACE_S = 5.0
# A certain hang is taken when two polls this far apart agree on it (a record read between two writes).
CONFIRM_S = 0.2
# ... and where the verdict rests on ranks that are all still inside calls (a cycle, fingerprints that cannot
# match), this far apart: a call that was completing can look open that long on a loaded node, when its rank
# is descheduled right after it returned and before it wrote its exit record.
CONFIRM_BLOCKED_S = 0.8


# Bounds on the evidence an interrupted launch takes before its teardown (the whole run ends within 2 s).
INTERRUPT_STACKS_S = 0.6
INTERRUPT_FLIGHT_RECORDER_S = 0.8


class Decision(enum.Enum):
    CONTINUE = "continue"
    RELEASE = "release"          # every rank finished: let them exit
    STALL = "stall"              # no progress while someone waits or died
    BUSY_TIMEOUT = "busy_timeout"  # a rank busy outside the collectives kept the others waiting past --busy-timeout
    DEADLOCK = "deadlock"        # a certain hang: nothing can release the waiting ranks (diagnose.waitfor)
    TIMEOUT = "timeout"          # the run's --timeout
    MAX_DURATION = "max_duration"  # the pre-flight window ended
    FAILED = "failed"            # the watchdog itself failed: end the job rather than hang
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM (``distcheck.interrupt``): ended like a stall, evidence first

    @property
    def end_reason(self) -> EndReason | None:
        """How a launch this decision ended is reported (None: it did not end the launch by itself)."""
        return _END_REASONS.get(self)


_END_REASONS = {Decision.STALL: EndReason.STALL, Decision.DEADLOCK: EndReason.CERTAIN_HANG,
                Decision.BUSY_TIMEOUT: EndReason.BUSY_TIMEOUT, Decision.TIMEOUT: EndReason.TIMEOUT,
                Decision.MAX_DURATION: EndReason.MAX_DURATION, Decision.INTERRUPTED: EndReason.INTERRUPTED}
@dataclass(frozen=True)
class Limits:
    stall_timeout: float = 10.0
    timeout: float | None = None
    max_duration: float | None = None
    startup_timeout: float = 120.0
    busy_timeout: float = 600.0     # how long to wait for a rank busy in user code while others wait


# What moves the stall clock: a rank's records, phase or liveness, each read for every rank in C (at 16,384 ranks a
# tuple built per rank in Python was most of node 0's poll but for the judgement's own; a list per field, a third)
_PROGRESS_STATE = tuple(map(operator.attrgetter, ("records", "phase", "alive")))


@dataclass
class StallDetector:
    """Decides, from successive observations, when a run must end and why."""

    world_size: int
    limits: Limits
    start: float
    last_progress: float = 0.0
    certain: CertainHang | None = None      # the certain hang a DEADLOCK decision rests on
    last_evidence: dict[int, float] = field(default_factory=dict)   # rank -> when it last showed progress
    _last_state: tuple | None = None
    _pending: tuple[tuple, float] | None = None    # a certain hang seen once, and when

    def __post_init__(self) -> None:
        self.last_progress = self.start

    def observe(self, now: float, ranks: Mapping[int, RankProgress]) -> Decision:
        order = sorted(ranks)
        progress = list(map(ranks.__getitem__, order))
        state = (order, *(list(map(field_of, progress)) for field_of in _PROGRESS_STATE))
        if state != self._last_state:
            self._last_state = state
            self.last_progress = now
        # Every rank finished, and no call is left waiting on the device (NCCL: a call returns before its work is
        # done; one that never completes is a hang, not a pass)
        if len(ranks) == self.world_size and all(p.phase == Phase.FINISHED and p.alive and not p.open_collectives
                                                 for p in ranks.values()):
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
        if self._certain(now, ranks):
            return Decision.DEADLOCK
        for r, p in ranks.items():
            if p.late:
                self.last_evidence[r] = max(self.last_evidence.get(r, float("-inf")), now - p.evidence_age)
        someone_waits = any(p.open_collectives > 0 and p.alive for p in ranks.values())
        someone_died = any(p.dead for p in ranks.values())
        if someone_died and idle >= min(self.limits.stall_timeout, 5.0) and self._synced(idle, ranks):
            return Decision.STALL   # normally the agent tears down first; this is the backstop
        if someone_waits and idle >= self.limits.stall_timeout:
            # Late is not hung: while a rank makes progress outside the collectives, it may still arrive.
            late = self.late_ranks(now, ranks)
            if idle < self.limits.busy_timeout and late:
                return Decision.CONTINUE
            if not self._synced(idle, ranks):
                return Decision.CONTINUE
            return Decision.BUSY_TIMEOUT if late else Decision.STALL
        return Decision.CONTINUE

    def _certain(self, now: float, ranks: Mapping[int, RankProgress]) -> bool:
        """A hang nothing can release, seen on two polls at least CONFIRM_S apart."""
        hang = certain_hang(ranks)
        if hang is None:
            self._pending = None
            return False
        key = (hang.ranks, hang.waiting, hang.reason)
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, now)
            return False
        if now - self._pending[1] < self._confirm_s(hang.reason):
            return False
        self.certain = hang
        return True

    @staticmethod
    def _confirm_s(reason: str) -> float:
        return CONFIRM_BLOCKED_S if reason in ("cycle", "clash") else CONFIRM_S

    def confirm_due(self) -> float | None:
        """When the certain hang seen once may be confirmed (clock time); None when none is pending."""
        if self._pending is None:
            return None
        (_, _, reason), seen_at = self._pending
        return seen_at + self._confirm_s(reason)

    def _synced(self, idle: float, ranks: Mapping[int, RankProgress]) -> bool:
        """Every live rank's record is settled, or distcheck waited SYNC_GRACE_S more for it: a sidecar
        descheduled on a loaded node delays the verdict instead of making it wrong."""
        behind = [r for r, p in ranks.items() if p.alive and p.phase == Phase.RUNNING and not p.settled]
        return not behind or idle >= self.limits.stall_timeout + SYNC_GRACE_S

    def late_ranks(self, now: float, ranks: Mapping[int, RankProgress]) -> list[int]:
        """Ranks outside the collectives that made progress within the last stall timeout."""
        return sorted(r for r, p in ranks.items()
                      if p.outside and now - self.last_evidence.get(r, float("-inf")) < self.limits.stall_timeout)

    def waiting_for_late(self, now: float, ranks: Mapping[int, RankProgress]) -> list[int]:
        """Ranks distcheck is waiting for past the stall timeout because they make progress."""
        waits = any(p.open_collectives > 0 and p.alive for p in ranks.values())
        if not waits or now - self.last_progress < self.limits.stall_timeout:
            return []
        return self.late_ranks(now, ranks)


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
    busy_lines: list[tuple[int, float, str]] = field(default_factory=list)
    # Why the run was ended, as the live view and the report say it: "certain: ranks 1-3 finished",
    # "stuck: no progress for 5.0 s ...". None while it was not ended by distcheck's verdict.
    evidence: str | None = None
    late_evidence: dict[int, str] = field(default_factory=dict)   # rank -> the progress a late rank showed


class Watchdog(threading.Thread):
    """Polls the ranks of one launch; on a stall or a limit, takes stacks and tears down."""

    def __init__(
        self, files: LaunchFiles, world_size: int, limits: Limits, poll_s: float = 0.1,
        on_poll: Callable[[Mapping[int, RankProgress], float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        channel: NodeChannel | None = None,
        generation: bool = False,
    ) -> None:
        super().__init__(name="distcheck-watchdog", daemon=True)
        self.files = files
        self.role = node_role(channel)   # alone, node 0 deciding for the job, or another node following it
        # One generation of a command that may go on (``launch.command``): the watch ends once its ranks
        # are released or all gone, and a teardown ends only its own ranks, not the command.
        self.generation = generation
        self.monitor = RankMonitor(files, world_size)
        self.clock = clock
        self.detector = StallDetector(world_size, limits, start=clock())
        self.poll_s = poll_s
        self.on_poll = on_poll
        self.result = WatchdogResult()
        self._stop_event = threading.Event()
        self._released = False
        self._wall_offset: float | None = None   # wall time minus ``clock``, taken at the first poll

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            if self.poll_once():
                return
            self._stop_event.wait(self.next_poll_in())

    def next_poll_in(self) -> float:
        """``poll_s``, or less where a certain hang seen once may be confirmed sooner: the second look comes
        when it is due, not up to a poll later (at 4,096 ranks a poll was 0.1 s of reading, and the second
        look fell 5 ms short of its 0.2 s and waited for a third)."""
        due = self.detector.confirm_due()
        if due is None:
            return self.poll_s
        return min(self.poll_s, max(0.0, due - self.clock() + 0.001))

    def poll_once(self) -> bool:
        """One poll: read the ranks, judge, act on the decision. True once the watch is over. ``run`` calls it
        every ``poll_s``; a caller that watches many launches from one thread may call it instead."""
        try:
            return self._poll()
        except Exception as exc:   # a watchdog that dies silently would let the job hang forever
            self.result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.result.lost_node_0 = self.role.lost_node_0(exc)
            self.result.decision = Decision.FAILED
            self.result.detected_at = time.time()
            self._tell_failed()
            self._tear_down({})
            return True

    def _tell_failed(self) -> None:
        """Node 0's watchdog failed: the other nodes end their ranks too. Untold, they ran on (a hung job's ranks
        held) until node 0's gather gave up on their traces, ``--rdzv-timeout`` and a minute later."""
        try:
            self.role.tell(Decision.FAILED.value, None, self.result.detected_at)
        except Exception:
            pass   # the store may be what failed: the other nodes then find node 0 gone

    def _poll(self) -> bool:
        """Read every rank, decide, act: release finished ranks, or end the job for the decision's reason."""
        progress, now = self._read(), self.clock()
        decision = self._decide(now, progress)
        if decision is Decision.RELEASE:
            return self._release()
        if self.generation and generation_over(progress, self.monitor.world_size):
            return True   # every rank left by itself: it ended, nothing stalled (see launch.command)
        if not self.role.decides:
            return self._follow(progress)
        if decision is Decision.CONTINUE:
            return False
        self._end(decision, now, progress)
        return True

    def _read(self) -> dict[int, RankProgress]:
        if self._wall_offset is None:
            self._wall_offset = time.time() - self.clock()
        progress = self.role.share(self.monitor.poll())
        self.result.last_progress = progress
        return progress

    def _decide(self, now: float, progress: Mapping[int, RankProgress]) -> Decision:
        decision = Decision.INTERRUPTED if interrupt.requested() else self.detector.observe(now, progress)
        self._sample_late(now, progress)
        if self.on_poll is not None:
            self.on_poll(progress, now - self.detector.last_progress)
        # node 0 saw every rank of the job finish (only it sees them all)
        return Decision.RELEASE if self.role.released() else decision

    def _release(self) -> bool:
        if not self._released:
            self.files.release.touch()
            self._released = True
            self.role.tell_released()
        return self.generation   # a generation whose ranks all finished has nothing left to judge

    def _follow(self, progress: dict[int, RankProgress]) -> bool:
        """Another node: it tears down for node 0's reason, when node 0 posts it."""
        posted = self.role.posted()
        if posted is None:
            return False
        self.result.decision = Decision(posted.decision)
        self.result.stall_onset, self.result.detected_at = posted.stall_onset, posted.detected_at
        self._tear_down(progress)
        return True

    def _end(self, decision: Decision, now: float, progress: dict[int, RankProgress]) -> None:
        self.result.decision = decision
        self.result.evidence = self._evidence(decision, now, progress)
        self.result.stall_onset = self.detector.last_progress + (self._wall_offset or 0.0)
        self.result.detected_at = time.time()
        self.role.tell(decision.value, self.result.stall_onset, self.result.detected_at)
        self._tear_down(progress)

    def _evidence(self, decision: Decision, now: float, progress: Mapping[int, RankProgress]) -> str | None:
        if decision is Decision.DEADLOCK and self.detector.certain is not None:
            return self.detector.certain.evidence
        if decision is Decision.INTERRUPTED:
            return f"interrupted: {interrupt.signal_name() or 'a signal'} after {now - self.detector.start:.1f} s"
        if decision is Decision.BUSY_TIMEOUT:
            late = rank_list(self.detector.late_ranks(now, progress))
            return (f"busy past --busy-timeout: {late} made progress outside the collectives, but the others "
                    f"waited {now - self.detector.last_progress:.1f} s for it")
        if decision is Decision.STALL:
            idle = now - self.detector.last_progress
            return (f"stuck: no rank made progress for {idle:.1f} s (no collective, no CPU, I/O or stack change "
                    f"outside the collectives)")
        return None

    def _sample_late(self, now: float, progress: Mapping[int, RankProgress]) -> None:
        """Once per rank and wait: where a rank that others wait for is busy (for the live view and the report)."""
        waiting_for = self.detector.waiting_for_late(now, progress)
        for rank in waiting_for:
            evidence = progress[rank].evidence
            if evidence:
                self.result.late_evidence[rank] = evidence
        for rank in [r for r in self.monitor.busy_at if r not in waiting_for]:
            del self.monitor.busy_at[rank]   # it arrived: a later wait for it is sampled again
        late = [r for r in waiting_for if r not in self.monitor.busy_at]
        if late:
            self.monitor.busy_stacks(late)
            self.result.busy_lines.extend((r, time.time(), self.monitor.busy_at[r])
                                            for r in late if r in self.monitor.busy_at)

    def _tear_down(self, progress: dict[int, RankProgress]) -> None:
        pids = self.monitor.pids()
        alive = tuple(sorted(r for r, pid in pids.items() if procs.is_alive(pid)))
        self.result.killed_ranks = alive
        hurry = self.result.decision is Decision.INTERRUPTED   # someone waits at the terminal
        self.files.flight_recorder_request.touch()   # served by ranks that run the Flight Recorder sidecar
        procs.request_stacks(self.files, pids, StackKind.STACKS, **({"wait_s": INTERRUPT_STACKS_S} if hurry else {}))
        procs.wait_for_files([self.files.flight_recorder(r) for r in alive
                              if r in self.monitor.status and self.monitor.status[r].flight_recorder],
                             timeout_s=INTERRUPT_FLIGHT_RECORDER_S if hurry else 2.0)
        # and, but between a command's generations, the last line: no process this launch started survives
        procs.terminate_tree([pid for pid in pids.values() if procs.is_alive(pid)], and_mine=not self.generation)
        self.result.torn_down_at = time.time()


def generation_over(ranks: Mapping[int, RankProgress], world_size: int) -> bool:
    """Every rank of a generation has been seen, and none is alive any more."""
    return len(ranks) == world_size and not any(p.alive for p in ranks.values())
