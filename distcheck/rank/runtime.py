"""What distcheck installs in a rank, owned by one object per process (``PROCESS``) and armed by one
function (``arm``), whichever way the rank was started: by distcheck's worker before the job runs, or by
the user's own command right after its ``init_process_group`` (``rank.injected``).

Each generation (a command re-initializes its group: a test suite's next test, a pool worker's next
task) is armed through the same ``arm``: its own status file, trace, C++-collective sidecar and
stack-probe target. What is process-wide is installed once and re-aimed: the DataLoader and
torchmetrics recorders, Lightning's attribution, one wrapper each of ``init_process_group`` and
``destroy_process_group``. Every attribute distcheck replaces goes through ``Patches``, so
``RankProcess.disarm`` puts every one of them back.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import json
import os
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcheck import torch_features
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stacks import torch_dir
from distcheck.models import Phase
from distcheck.rank import guard, integrations, metrics, native, samples
from distcheck.rank.callsite import USER, classify_file
from distcheck.rank.guard import Hook, failed
from distcheck.rank.issuers import traceback_frames
from distcheck.rank.patches import Patches
from distcheck.rank.stack_probe import StackProbe
from distcheck.rank.ticker import TICKER
from distcheck.rank.tracer import Tracer, install

FLIGHT_RECORDER_ENV = "DISTCHECK_FLIGHT_RECORDER"
# How long a rank that ends its work, or destroys its group, gives its calls still waiting on the device (NCCL) to
# complete before its record is closed: a healthy call completes in milliseconds; one that never does is a hang.
SETTLE_S = 1.0


class Status:
    """This rank's status file, rewritten atomically on every phase change."""

    def __init__(self, files: LaunchFiles, rank: int, main_thread: int | None = None) -> None:
        self.files, self.rank = files, rank
        self._lock = threading.Lock()
        files.status(rank).parent.mkdir(parents=True, exist_ok=True)
        self.data = RankStatus(
            rank=rank, pid=os.getpid(), host=socket.gethostname(), node=int(os.environ.get("GROUP_RANK", "0")),
            main_thread=main_thread or threading.main_thread().ident, t_start=time.time(),
        )

    def update(self, **fields: Any) -> None:
        with self._lock:   # the main thread and the C++-collective sidecar both report here
            self.data = dataclasses.replace(self.data, **fields, t_update=time.time())
            self.files.write_status(self.rank, self.data)


@dataclass
class RankRuntime:
    """One generation of a traced rank: its status file, its tracer and the C++-collective sidecar."""

    files: LaunchFiles
    status: Status
    tracer: Tracer
    watcher: native.NativeWatcher
    sidecar: native.Sidecar

    @property
    def ours(self) -> bool:
        """Armed in this very process (a fork of a rank inherits its parent's runtime, not its role)."""
        return self.status.data.pid == os.getpid()


@dataclass
class RankProcess:
    """Everything distcheck installed in this process, and the generation it serves now."""

    patches: Patches = field(default_factory=Patches)
    probe: StackProbe = field(default_factory=StackProbe)
    current: RankRuntime | None = None
    ended: RankRuntime | None = None    # the generation destroy_process_group ended (its failures are still its)
    exited: bool = False                # the process's own end was recorded
    generations: int = 0                # armed so far in this process
    recorders_armed: bool = False
    end_hooks: bool = False             # a command's rank: sys.excepthook, sys.exit and atexit record its end
    wrapped: bool = False
    _sigterm_file: Any = None           # where faulthandler writes a SIGTERM's stacks (this generation's)
    enabled_faulthandler: bool = False  # distcheck turned faulthandler on (the user had not): off again on disarm
    moved_fds: tuple[int, ...] | None = None   # of stdout/stderr, those now written to the rank's log (None: not yet)
    on_init: list[Callable[[], None]] = field(default_factory=list)        # after init_process_group returns
    on_destroy: list[Callable[[Any, Any], None]] = field(default_factory=list)   # (c10d, group), before destroy

    def arm(self, files: LaunchFiles, rank: int, *, script: bool, main_thread: int | None = None,
            command: bool = False) -> RankRuntime:
        """Trace this process as ``rank`` of the generation whose files are ``files``; ``command``: a rank
        the user's own command started (no launcher of distcheck's sees how it ends)."""
        if self.generations:
            guard.reset()   # a new generation reports its own hook failures
        self.generations += 1
        status = Status(files, rank, main_thread)
        status.update(phase=Phase.STARTING)
        guard.set_publisher(lambda counts: status.update(hook_failures=counts))
        _guarded(Hook.STACK_DUMPS, lambda: self._arm_stacks(files, rank, main_thread, command))
        if os.environ.get(FLIGHT_RECORDER_ENV) == "1":
            start_flight_recorder_sidecar(files, rank)
            status.update(flight_recorder=True)
        tracer = install(files.trace(rank), rank)
        watcher = native.NativeWatcher(tracer, main_thread=main_thread or threading.main_thread().ident,
                                       on_unwatched=lambda why: status.update(unwatched=why))
        tracer.segment_listeners.append(watcher)
        sidecar = native.start(watcher)
        self._arm_recorders(files, rank, script)
        self.current = RankRuntime(files, status, tracer, watcher, sidecar)
        _guarded(Hook.RANK_SETUP, self.wrap_process_group_calls)
        return self.current

    def write_output_to(self, log: Path, command_output: Path | None = None) -> None:
        """From here on the rank's stdout and stderr go to ``log``: those of them that still write where the command
        as a whole writes (``command_output``; a Slurm step's forwarding pipe); one the command sent elsewhere (``>
        out.txt``, a pipe, pytest's ``capfd``) stays there. Where they went before is kept, put back on disarm."""
        if self.moved_fds is None:
            self.moved_fds = tuple(fd for fd in (1, 2) if command_output is None or _writes_to(fd, command_output))
            kept = {fd: os.dup(fd) for fd in self.moved_fds}
            self.patches.on_undo(lambda: self._put_output_back(kept))
        redirect_output(log, self.moved_fds)

    def _put_output_back(self, kept: dict[int, int]) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for fd, saved in kept.items():
            os.dup2(saved, fd)
            os.close(saved)
        self.moved_fds = None

    def _arm_stacks(self, files: LaunchFiles, rank: int, main_thread: int | None, command: bool) -> None:
        """Stacks on the watchdog's request from a thread of distcheck's own (no signal, so no handler of
        the user's is ever fired or replaced); fatal-error tracebacks on the rank's stderr, as faulthandler
        writes them (the rank's log keeps distcheck's copy), unless the user enabled it already. A command's
        rank whose SIGTERM has no handler of its own also leaves where a SIGTERM found it (chained: the default
        then ends it as before), so a rank its launcher terminated after another one died is told from the
        one that died first: no launcher of distcheck's sees those ranks' exit statuses."""
        if not faulthandler.is_enabled() and sys.stderr is not None:
            faulthandler.enable(file=sys.stderr, all_threads=True)
            self.enabled_faulthandler = True
        self.probe.aim(files, rank, main_thread)
        if command and (self._sigterm_file is not None or signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            self._dump_on_sigterm(files.terminated_stack(rank))

    def _dump_on_sigterm(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # no with-block: the file stays open for faulthandler until the next one replaces it
        previous, self._sigterm_file = self._sigterm_file, open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        faulthandler.register(signal.SIGTERM, file=self._sigterm_file, all_threads=True, chain=True)
        if previous is not None:
            previous.close()

    def _arm_recorders(self, files: LaunchFiles, rank: int, script: bool) -> None:
        """Installed once per process; a later generation's records go into its own files. A script's
        DataLoader passes go to a file; a scenario's go out with its results (``scenario.results()``)."""
        if self.recorders_armed:
            _guarded(Hook.SAMPLES, lambda: samples.aim(files.samples(rank)))
            _guarded(Hook.METRICS, lambda: metrics.aim(files.metrics(rank)))
            return
        self.recorders_armed = True
        if script:
            _guarded(Hook.RANK_SETUP, lambda: integrations.install(self.patches))
        _guarded(Hook.RANK_SETUP, lambda: samples.SampleRecorder(files.samples(rank) if script else None).install(
            self.patches))
        _guarded(Hook.RANK_SETUP, lambda: metrics.install(files.metrics(rank), self.patches))   # once imported

    def wrap_process_group_calls(self) -> None:
        """One wrapper of ``init_process_group`` (then ``on_init``) and one of ``destroy_process_group``
        (the generation's C++-issued calls flushed into its trace first, then ``on_destroy``)."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if self.wrapped or c10d is None:
            return
        self.wrapped = True
        dist = sys.modules.get("torch.distributed")
        for name, wrapper in (("init_process_group", self._wrapped_init), ("destroy_process_group",
                                                                           self._wrapped_destroy)):
            original = getattr(c10d, name)
            wrapped = functools.wraps(original)(wrapper(original, c10d))
            wrapped.__distcheck__ = True   # type: ignore[attr-defined]
            self.patches.set(c10d, name, wrapped)
            if dist is not None and getattr(dist, name, None) is original:   # torch.distributed re-exports it
                self.patches.set(dist, name, wrapped)

    def _wrapped_init(self, original: Callable[..., Any], c10d: Any) -> Callable[..., Any]:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            for callback in list(self.on_init):
                _guarded(Hook.RANK_SETUP, callback)   # the user's init returns all the same (rule 0)
            return result
        return init_process_group

    def _wrapped_destroy(self, original: Callable[..., Any], c10d: Any) -> Callable[..., Any]:
        def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
            runtime = self.current
            if runtime is not None and runtime.ours:   # never keeps the user's call from running
                _guarded(Hook.SIDECAR, lambda: runtime.watcher.flush(settle_s=SETTLE_S))
            for callback in list(self.on_destroy):
                _guarded(Hook.RANK_END, lambda: callback(c10d, group))  # noqa: B023 - called right here
            return original(group, *args, **kwargs)
        return destroy_process_group

    def stop_watching(self, runtime: RankRuntime) -> None:
        """The generation ``runtime`` serves is over (its default group destroyed, or the process disarmed): no
        thread of distcheck's polls for it and no file of its stays open in the process."""
        runtime.sidecar.stop()
        stop_flight_recorder_sidecar()
        self.probe.stop()
        if self._sigterm_file is not None:
            faulthandler.unregister(signal.SIGTERM)
            self._sigterm_file.close()
            self._sigterm_file = None

    def retire(self, runtime: RankRuntime) -> None:
        """``runtime``'s generation is over: its tracer and sidecar write nothing more, so a later generation's
        calls never land in its trace, and nothing of distcheck's keeps its groups alive."""
        runtime.tracer.uninstall()
        self.stop_watching(runtime)
        with runtime.tracer.lock:
            # It must not read the next generation's groups, nor keep this one's alive (a poll may outlast the stop).
            runtime.watcher.groups = lambda: ()
            runtime.watcher.pgs = {}
        runtime.tracer.close()   # calls through a wrapper bound earlier are dropped, not written here
        # Forget every group it cached: a group kept alive keeps its store, and a TCPStore server kept
        # listening takes the port the next generation's rank 0 binds (the pool re-inits on one port).
        runtime.tracer.begin_segment("generation ended")

    def disarm(self) -> None:
        """Put back everything distcheck installed in this process and stop tracing it: every attribute it
        replaced, every import finder it added, its recorders, its exit hooks, its threads and open files, and
        faulthandler as the user had it. Armed again later, it starts from nothing (``tests/test_rule0_disarm.py``)."""
        runtime = self.current
        if runtime is not None and runtime.ours:
            _guarded(Hook.RANK_END, lambda: self.retire(runtime))
        self.patches.undo()
        self.probe.stop()
        stop_flight_recorder_sidecar()
        TICKER.clear()
        if self.enabled_faulthandler:
            faulthandler.disable()
        guard.set_publisher(None)   # the counts stay; no file of a generation that is over is written
        self.current = self.ended = None
        self.wrapped = self.recorders_armed = self.end_hooks = self.enabled_faulthandler = False
        self.on_init.clear()
        self.on_destroy.clear()


PROCESS = RankProcess()


def arm(files: LaunchFiles, rank: int, *, script: bool, main_thread: int | None = None,
        command: bool = False) -> RankRuntime:
    """The one way a rank is traced, however it was started (``RankProcess.arm``)."""
    return PROCESS.arm(files, rank, script=script, main_thread=main_thread, command=command)


def redirect_output(path: Path, fds: tuple[int, ...] = (1, 2)) -> None:
    """This process's stdout and stderr (the descriptors ``fds``, so its C++ output too) appended to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    for target in fds:
        os.dup2(fd, target)
    os.close(fd)


def _writes_to(fd: int, command_output: Path) -> bool:
    """``fd`` writes where the command's output goes: the very file, or (a task of a Slurm step, whose output srun
    forwards into it) a pipe or socket."""
    try:
        mode, shown = os.fstat(fd), os.stat(command_output)
    except OSError:
        return False
    if (mode.st_dev, mode.st_ino) == (shown.st_dev, shown.st_ino):
        return True
    return "SLURM_STEP_ID" in os.environ and (stat.S_ISFIFO(mode.st_mode) or stat.S_ISSOCK(mode.st_mode))


def _guarded(hook: Hook, call: Callable[[], Any]) -> None:
    """One of distcheck's installations in a rank; its failure counted (rule 0), the others still made."""
    try:
        call()
    except Exception as exc:
        failed(hook, exc)


FLIGHT_RECORDER_TASK = "flight-recorder"


def start_flight_recorder_sidecar(files: LaunchFiles, rank: int) -> None:
    """On the launcher's request, dump PyTorch's Flight Recorder (GPU-side state on NCCL), once per generation.

    A task of the rank's thread of distcheck's (``rank.ticker``), because the main thread may be blocked inside
    the collective; collectives release the GIL while they wait, so it runs. It ends with its generation
    (``stop_flight_recorder_sidecar``)."""
    def serve() -> None:
        if not files.flight_recorder_request.exists():
            return
        try:
            _dump_flight_recorder(files, rank)
        except Exception as exc:   # counted, never printed (rule 0)
            failed(Hook.SIDECAR, exc)
        finally:
            TICKER.remove(FLIGHT_RECORDER_TASK)

    TICKER.every(FLIGHT_RECORDER_TASK, 0.05, serve, Hook.SIDECAR)


def stop_flight_recorder_sidecar() -> None:
    TICKER.remove(FLIGHT_RECORDER_TASK)


def _dump_flight_recorder(files: LaunchFiles, rank: int) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not callable(getattr(dist, "is_initialized", None)) or not dist.is_initialized():
        # no process group yet (torch perhaps still loading: importing it from here would race the user's import)
        data = json.dumps({"error": "RuntimeError: no process group yet, so no Flight Recorder"}).encode()
    else:
        dump_json = torch_features.fr_dump_json_function()
        try:
            if dump_json is None:
                raise RuntimeError(torch_features.recorder_problem(None) or "no Flight Recorder")
            data = dump_json()
        except Exception as exc:   # a recorder that is off
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
    path = files.flight_recorder(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else str(data).encode())
    os.replace(tmp, path)


def user_frame_of(tb: Any) -> str | None:
    """file:line:function of the innermost user frame of a traceback."""
    torch = torch_dir()
    where = None
    for frame in traceback.extract_tb(tb):
        if classify_file(frame.filename, torch) == USER:
            where = f"{frame.filename}:{frame.lineno}:{frame.name}"
    return where


def flush_native(runtime: RankRuntime, exc: BaseException | None = None) -> None:
    """The rank's C++-issued calls are all in its trace (before it says it finished or failed), and its calls
    still waiting on the device (NCCL) had ``SETTLE_S`` to complete. A failure's traceback says where the call
    that raised was issued (``loss.backward()``)."""
    try:
        runtime.watcher.flush(traceback_frames(exc.__traceback__) if exc is not None else None,
                              settle_s=0.0 if exc is not None else SETTLE_S)
    except Exception as err:   # a failing flush must not hide the rank's own end
        failed(Hook.SIDECAR, err)


def finish_rank(runtime: RankRuntime, results: dict[str, Any]) -> None:
    """The rank's work is done: its last C++-issued calls are in the trace before "finished"."""
    flush_native(runtime)
    _guarded(Hook.SAMPLES, samples.flush)   # passes cut short whose iterators are still alive
    try:
        results = {**results, **metrics.results()}   # a script's metrics (a scenario's went with its results)
    except Exception as exc:
        failed(Hook.METRICS, exc)
    runtime.status.update(phase=Phase.FINISHED, collectives=runtime.tracer.count, results=results,
                          hook_failures=guard.failures() or None)


def record_failure(status: Status, exc: BaseException, collectives: int, exit_code: int) -> None:
    """The rank's own failure, with the user's line it was raised at."""
    tb = exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    status.update(
        phase=Phase.ERROR, collectives=collectives, exit_code=exit_code,
        exception=f"{type(exc).__name__}: {message}"[:500], traceback=text[-8000:], where=user_frame_of(tb),
        hook_failures=guard.failures() or None,
    )


def wait_for_release(files: LaunchFiles, still_wanted: Callable[[], bool] = lambda: True) -> None:
    """Idle like a healthy rank whose peers are stuck, until the launcher says stop
    (or ``still_wanted`` says nobody is left to say it)."""
    while not files.release.exists() and still_wanted():
        time.sleep(0.05)
