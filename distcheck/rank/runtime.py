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
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distcheck import torch_features
from distcheck.files.launch_dir import LaunchFiles, RankStatus
from distcheck.files.stacks import torch_dir
from distcheck.models import Phase
from distcheck.rank import guard, integrations, metrics, native, samples
from distcheck.rank.callsite import USER, classify_file
from distcheck.rank.guard import Hook, failed
from distcheck.rank.stack_probe import StackProbe
from distcheck.rank.tracer import Tracer, install

FLIGHT_RECORDER_ENV = "DISTCHECK_FLIGHT_RECORDER"


class Patches:
    """Every attribute distcheck replaced, with what was there, so that all can be put back
    (pytest's ``monkeypatch`` keeps the same record)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            setattr(owner, name, old)


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
            start_flight_recorder_sidecar(files, rank, still_wanted=lambda: self.current is None
                                          or self.current.files is files)
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

    def _arm_stacks(self, files: LaunchFiles, rank: int, main_thread: int | None, command: bool) -> None:
        """Stacks on the watchdog's request from a thread of distcheck's own (no signal, so no handler of
        the user's is ever fired or replaced); fatal-error tracebacks on the rank's stderr, as faulthandler
        writes them (the rank's log keeps distcheck's copy), unless the user enabled it already. A command's
        rank whose SIGTERM has no handler of its own also leaves where a SIGTERM found it (chained: the default
        then ends it as before), so a rank its launcher terminated after another one died is told from the
        one that died first: no launcher of distcheck's sees those ranks' exit statuses."""
        if not faulthandler.is_enabled() and sys.stderr is not None:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        self.probe.aim(files, rank, main_thread)
        if command and (self._sigterm_file is not None or signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            self._dump_on_sigterm(files.terminated_stack(rank))

    def _dump_on_sigterm(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        previous, self._sigterm_file = self._sigterm_file, open(path, "a", buffering=1, encoding="utf-8")
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
            _guarded(Hook.RANK_SETUP, integrations.install)
        _guarded(Hook.RANK_SETUP, samples.SampleRecorder(files.samples(rank) if script else None).install)
        _guarded(Hook.RANK_SETUP, lambda: metrics.install(files.metrics(rank)))   # once the job imports it

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
            if runtime is not None and runtime.ours:
                _guarded(Hook.SIDECAR, runtime.watcher.flush)   # never keeps the user's call from running
            for callback in list(self.on_destroy):
                _guarded(Hook.RANK_END, lambda: callback(c10d, group))
            return original(group, *args, **kwargs)
        return destroy_process_group

    def disarm(self) -> None:
        """Put back everything distcheck replaced in this process and stop tracing it."""
        self.patches.undo()
        if self._sigterm_file is not None:
            faulthandler.unregister(signal.SIGTERM)
        self.wrapped = False
        if self.current is not None:
            self.current.tracer.uninstall()
        self.probe.stop()


PROCESS = RankProcess()


def arm(files: LaunchFiles, rank: int, *, script: bool, main_thread: int | None = None,
        command: bool = False) -> RankRuntime:
    """The one way a rank is traced, however it was started (``RankProcess.arm``)."""
    return PROCESS.arm(files, rank, script=script, main_thread=main_thread, command=command)


def _guarded(hook: Hook, call: Callable[[], Any]) -> None:
    """One of distcheck's installations in a rank; its failure counted (rule 0), the others still made."""
    try:
        call()
    except Exception as exc:
        failed(hook, exc)


def start_flight_recorder_sidecar(files: LaunchFiles, rank: int, still_wanted: Callable[[], bool]) -> None:
    """On the launcher's request, dump PyTorch's Flight Recorder (GPU-side state on NCCL).

    A thread, because the main thread may be blocked inside the collective; collectives release the
    GIL while they wait, so this thread runs. It ends with its generation.
    """
    def serve() -> None:
        try:
            while not files.flight_recorder_request.exists():
                if not still_wanted():
                    return
                time.sleep(0.05)
            _dump_flight_recorder(files, rank)
        except Exception as exc:   # a thread of distcheck's own: its failure is counted, never printed (rule 0)
            failed(Hook.SIDECAR, exc)

    threading.Thread(target=serve, name="distcheck-flight-recorder", daemon=True).start()


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
    """The rank's C++-issued calls are all in its trace (before it says it finished or failed).
    A failure's traceback says where the call that raised was issued (``loss.backward()``)."""
    try:
        runtime.watcher.flush(native.traceback_frames(exc.__traceback__) if exc is not None else None)
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
