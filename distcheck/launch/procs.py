"""Process hygiene: stack requests, SIGTERM → grace → SIGKILL of whole trees."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import psutil

from distcheck.diagnose.progress import Signs
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stack_requests import StackKind, answer_path, write_request
from distcheck.launch import stack_reader


def is_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ProcStat(NamedTuple):
    alive: bool
    cpu_seconds: float    # user + system
    rss_bytes: int


_PROC = os.path.isdir("/proc/self")
_TICKS = os.sysconf("SC_CLK_TCK") if _PROC else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if _PROC else 4096


def stat_of(pid: int) -> ProcStat:
    """Whether ``pid`` runs, its CPU time and resident memory: on Linux from one read of ``/proc/<pid>/stat``
    (psutil reads it, and ``statm``, once for each); elsewhere through psutil."""
    if not _PROC:
        return _stat_of_psutil(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return _GONE
    # after the command's name: state, ..., utime (12th), stime (13th), ..., rss in pages (22nd)
    state = fields[0]
    return ProcStat(state not in (b"Z", b"X", b"x"), (int(fields[11]) + int(fields[12])) / _TICKS,
                    int(fields[21]) * _PAGE)


_GONE = ProcStat(False, 0.0, 0)


def _stat_of_psutil(pid: int) -> ProcStat:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return _GONE
        times = proc.cpu_times()
        return ProcStat(True, times.user + times.system, proc.memory_info().rss)
    except psutil.Error:
        return _GONE


# Helpers that serve every launch of this distcheck run and end with it (``launch.forkserver``): never
# terminated between launches, while the ranks forked from them are.
_kept: set[int] = set()


def keep(pid: int) -> None:
    _kept.add(pid)


def _below(roots: Iterable[int], children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [c for root in roots for c in children.get(root, ())]
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, ()))
    return out


def request_stacks(files: LaunchFiles, pids: dict[int, int], kind: StackKind, wait_s: float = 1.5) -> None:
    """Ask every live rank's stack probe (a thread of distcheck's own in the rank: no signal) and wait
    for the answers; a rank that did not answer in time (its main thread holds the GIL in C) is read
    from outside with py-spy where it is installed."""
    number = time.time_ns()   # higher than any earlier request, whichever watchdog made it
    before: dict[int, int] = {}
    for rank, pid in pids.items():
        if not is_alive(pid):
            continue
        path = answer_path(files, rank, kind)
        before[rank] = path.stat().st_size if path.exists() else 0
        write_request(files, rank, number, kind)
    pending = _wait_for_growth(files, kind, before, wait_s)
    outside = stack_reader.read_all([pids[r] for r in pending if is_alive(pids[r])])
    for rank in pending:
        text = outside.get(pids[rank])
        if text and not _grew(answer_path(files, rank, kind), before[rank]):   # the probe may answer late
            _append(answer_path(files, rank, kind), text)


def _grew(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size > size
    except FileNotFoundError:
        return False


def _wait_for_growth(files: LaunchFiles, kind: StackKind, before: dict[int, int], wait_s: float) -> list[int]:
    """The ranks whose answer file has not grown by the deadline."""
    deadline = time.monotonic() + wait_s
    pending = dict(before)
    while pending and time.monotonic() < deadline:
        for rank, size in list(pending.items()):
            if _grew(answer_path(files, rank, kind), size):
                pending.pop(rank)
        time.sleep(0.02)
    return sorted(pending)


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def terminate(processes: Iterable[psutil.Process], grace_s: float = 2.0) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL what is left. Returns the pids signalled.

    All of them are stopped (SIGSTOP) before any is signalled, and continued once all were: on a loaded
    node this process can lose the CPU between two signals, however tight the loop, and the ranks that died
    first would show the others a "Connection closed by peer" that they print as a traceback of their own
    before their own SIGTERM comes. A stopped process cannot run a line of its own; one whose SIGTERM has
    no handler dies of it at once, stopped or not, and one with a handler runs it once continued."""
    procs = [p for p in processes if p.pid != os.getpid()]
    stopped = []
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)   # psutil's check that the pid is still this process's
            stopped.append(p)
        except psutil.Error:
            pass
    try:
        signalled = [p.pid for p in stopped if _signal(p.pid, signal.SIGTERM)]
    finally:
        for p in stopped:
            _signal(p.pid, signal.SIGCONT)   # never left stopped, whatever happened in between
    alive = _wait_gone(procs, grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(alive, 2.0)
    return signalled


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:   # gone meanwhile
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes are dead (zombies count) and return those still alive.

    Never reaps: the ranks are the launcher's own children, and a child reaped here
    would read as exit code 0 to the launcher's ``Popen.poll()`` (ECHILD), so a rank
    killed in a stall teardown would count as a success (and make the launcher wait
    out torch's 300 s exit barrier for the other nodes).
    """
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    pause = 0.001   # a rank that ends at its SIGTERM is gone in a millisecond or two: no 20 ms nap first
    while alive and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(0.02, pause * 2)
        alive = [p for p in alive if _running(p)]
    return alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE   # is_running: not a reused pid
    except psutil.Error:
        return False


def terminate_tree(root_pids: Iterable[int], grace_s: float = 2.0, and_mine: bool = False) -> list[int]:
    """Terminate the given processes and everything below them (but what ``keep`` names), and with
    ``and_mine`` everything below this process too (``kill_descendants``, in the same go). One scan
    of the process table serves them all: psutil's ``children`` scans the whole table once per call, and a
    node of 8 ranks beside hundreds of processes scanned it 9 times per teardown."""
    roots = list(dict.fromkeys(root_pids))
    below = [p for p in _below(roots + [os.getpid()] * and_mine, _children_table(time.monotonic(), 0.0))
             if p not in _kept]
    return terminate(_processes(dict.fromkeys(roots + below)), grace_s)


def kill_descendants(grace_s: float = 2.0) -> list[int]:
    """The last line of defence: no process this launcher started survives it (but what ``keep`` names)."""
    return terminate_tree([], grace_s, and_mine=True)


def wait_for_files(paths: Iterable[Path], timeout_s: float) -> None:
    """Until every path exists or the deadline passes (ranks answering a dump request)."""
    pending = list(paths)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.exists()]
        if pending:
            time.sleep(0.02)



class CpuMeter:
    """How many cores each process used over the last ``window_s`` (user + system time)."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._samples: dict[int, list[tuple[float, float]]] = {}   # key -> [(monotonic, cpu seconds)]

    def cores(self, key: int, used: float | None, now: float) -> float | None:
        """Given the process's CPU seconds ``used`` now (None: it is gone); None until there is a window's
        worth of samples (or when the process is gone)."""
        if used is None:
            self._samples.pop(key, None)
            return None
        samples = self._samples.setdefault(key, [])
        samples.append((now, used))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.pop(0)
        t0, c0 = samples[0]
        if now - t0 < self.window_s / 2:
            return None
        return max(0.0, (used - c0) / (now - t0))


class ActivityMeter:
    """Evidence that a rank outside every collective is making progress, not CPU alone.

    Per rank and sample: CPU used by its whole process tree (a preprocessing subprocess, data-loader
    workers and children already reaped count); bytes its tree read or wrote (``/proc/<pid>/io``
    rchar/wchar: files and pipes); and how often its main thread woke up (the context switches of
    ``/proc/<pid>/status``, the main thread's alone: a socket read, which rchar does not count, wakes it
    each time data comes; a thread blocked for good on a lock, a queue or an event never wakes). Samples are at least
    ``interval_s`` apart (a tree walk scans /proc); the children list is refreshed every
    ``children_s``.
    """

    def __init__(self, interval_s: float = 0.5, children_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.children_s = children_s
        self._last: dict[int, _Totals] = {}
        self._tree: dict[int, tuple[float, list[psutil.Process], frozenset[int] | None]] = {}
        self.latest: dict[int, Activity] = {}

    def sample(self, rank: int, pid: int | None, now: float) -> Activity | None:
        """What the rank did since the last sample; None when not due yet (the previous one stays in
        ``latest``) or when the process is gone."""
        last = self._last.get(rank)
        if last is not None and now - last.at < self.interval_s:
            return None
        totals = self._totals(rank, pid, now)
        if totals is None:
            self._last.pop(rank, None)
            return None
        self._last[rank] = totals
        if last is None:
            return None
        self.latest[rank] = totals.since(last)
        return self.latest[rank]

    def forget(self, rank: int) -> None:
        """The rank is inside a collective: what its tree does there (a backend spinning on a core) is no
        evidence of progress outside, so its next sample starts afresh."""
        self._last.pop(rank, None)
        self.latest.pop(rank, None)

    def rebaseline(self, rank: int, pid: int | None, now: float) -> None:
        """Forget what was counted so far (distcheck's own stack request made the rank write)."""
        totals = self._totals(rank, pid, now)
        if totals is not None:
            self._last[rank] = totals

    def _totals(self, rank: int, pid: int | None, now: float) -> _Totals | None:
        if not pid:
            return None
        when, tree, kids = self._tree.get(rank, (0.0, [], None))
        now_kids = _main_thread_children(pid)
        # A child the main thread just started (a subprocess it waits for, a data loader's workers) is read at
        # once, not up to two table scans later: a rank late by its child's work looked idle that long. A rank
        # with no child needs no fresh scan (its first sample forced one per rank: at 4,096 ranks of simulated
        # nodes on one host, 4,096 scans of 4,300 processes were most of attach's time).
        started = bool(now_kids) and now_kids != kids
        if not tree or tree[0].pid != pid or now - when >= self.children_s or started:
            try:
                tree = [psutil.Process(pid), *_processes(self._descendants(pid, now, fresh=started))]
            except psutil.Error:
                return None
            self._tree[rank] = (now, tree, now_kids)
        try:
            switches = tree[0].num_ctx_switches()   # /proc/<pid>/status: the main thread's own
        except psutil.Error:
            return None
        per_process: dict[int, tuple[float, int]] = {}
        reaped = 0.0
        for i, p in enumerate(tree):
            try:
                t = p.cpu_times()
            except psutil.Error:
                if i == 0:
                    return None
                continue
            try:
                io = p.io_counters()
                written = io.read_chars + io.write_chars
            except (psutil.Error, AttributeError):   # not readable (a zombie, another user's): its CPU still counts
                written = 0
            # a child already reaped is the main process's children_* time: a child's work, not its own
            reaped += t.children_user + t.children_system
            per_process[p.pid] = (t.user + t.system, written)
        return _Totals(now, pid, per_process, reaped, switches.voluntary + switches.involuntary)

    def _descendants(self, pid: int, now: float, fresh: bool = False) -> list[int]:
        """Every descendant of ``pid``, from one scan of the process table per ``children_s`` shared by
        all ranks and every meter of this process (psutil's ``children`` scans the whole table for each
        call: a node of 8 ranks beside hundreds of processes spent most of its poll there); ``fresh``: a
        scan of now (a child was just started)."""
        return _below([pid], _children_table(now, 0.0 if fresh else self.children_s))


def _main_thread_children(pid: int) -> frozenset[int] | None:
    """The children the process's main thread started (Linux's ``/proc/<pid>/task/<pid>/children``: one small
    read); None where the kernel does not offer it."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return frozenset(int(c) for c in f.read().split())
    except (OSError, ValueError):
        return None


_table: tuple[float, dict[int, list[int]]] = (float("-inf"), {})   # when, ppid -> child pids
_table_lock = threading.Lock()


def _children_table(now: float, max_age_s: float) -> dict[int, list[int]]:
    """ppid -> child pids, scanned anew when older than ``max_age_s``."""
    global _table
    with _table_lock:
        when, children = _table
        if now - when >= max_age_s:
            children = {}
            for pid, ppid in _parents():
                children.setdefault(ppid, []).append(pid)
            _table = (now, children)
        return children


def _parents() -> Iterable[tuple[int, int]]:
    """(pid, parent pid) of every process: on Linux from each ``/proc/<pid>/stat`` (a third of what
    psutil's scan costs, which builds a handle per process); elsewhere through psutil."""
    if not _PROC:
        for proc in psutil.process_iter(["ppid"]):
            yield proc.pid, proc.info["ppid"]
        return
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    yield int(name), int(f.read().rpartition(b")")[2].split(maxsplit=2)[1])
            except (OSError, ValueError, IndexError):   # gone since the listing
                continue


def _processes(pids: Iterable[int]) -> list[psutil.Process]:
    """Handles on those of ``pids`` still running (a child may end between the scan and now)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out


class Activity(NamedTuple):
    """What a rank's process tree did between two samples, and which of its processes did it."""

    at: float          # when the sample was taken (monotonic)
    span: float        # over how many seconds
    cores: float       # CPU of the whole tree
    io_bytes: int      # read or written by the tree (files, pipes)
    wakeups: int       # times the main thread woke up
    child_cores: float = 0.0    # of ``cores``, what its children used (data-loader workers, subprocesses)
    child_io_bytes: int = 0     # of ``io_bytes``, what its children read or wrote
    children: tuple[int, ...] = ()   # the pids of the children that did it, busiest first (at most 3)

    def signs(self) -> Signs:
        """These counters as ``diagnose.progress`` reads them."""
        return Signs(span=self.span, cores=self.cores, io_bytes=self.io_bytes, wakeups=self.wakeups,
                     child_cores=self.child_cores, child_io_bytes=self.child_io_bytes, children=tuple(self.children))


class _Totals(NamedTuple):
    """One sample's counters of a rank's tree: per process (pid -> CPU seconds, I/O bytes)."""

    at: float
    main: int                                    # the rank's own pid
    per_process: dict[int, tuple[float, int]]
    reaped_cpu: float                            # children already reaped (their CPU, counted by their parents)
    wakeups: int

    def since(self, last: _Totals) -> Activity:
        span = self.at - last.at
        cpu = {pid: max(0.0, c - last.per_process.get(pid, (0.0, 0))[0]) for pid, (c, _) in self.per_process.items()}
        io = {pid: max(0, b - last.per_process.get(pid, (0.0, 0))[1]) for pid, (_, b) in self.per_process.items()}
        reaped = max(0.0, self.reaped_cpu - last.reaped_cpu)
        child_cpu = sum(c for pid, c in cpu.items() if pid != self.main) + reaped
        child_io = sum(b for pid, b in io.items() if pid != self.main)
        busiest = sorted((pid for pid in cpu if pid != self.main and (cpu[pid] > 0 or io[pid] > 0)),
                         key=lambda pid: (-cpu[pid], -io[pid], pid))
        return Activity(self.at, span, (cpu.get(self.main, 0.0) + child_cpu) / span, io.get(self.main, 0) + child_io,
                        max(0, self.wakeups - last.wakeups), child_cpu / span, child_io, tuple(busiest[:3]))


@contextlib.contextmanager
def environment_with(extra: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``extra`` set (what the agent copies into every worker, what a fork
    server loads torch under), restored afterwards as it was, whatever was set meanwhile (torch's launcher sets
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in the process that calls it: under the pytest plugin, the user's pytest)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
