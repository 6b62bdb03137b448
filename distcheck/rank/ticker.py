"""The one thread distcheck runs in a rank, and the periodic work it does (rule 0: the job cannot see it).

Three things in a rank must run while its main thread is blocked in a collective: the C++-collective sidecar
(``rank.native``), the stack probe (``rank.stack_probe``) and the Flight Recorder dump on request
(``rank.runtime``). Each is a task of one ``Ticker``, which calls the tasks that are due every
``TICK_S`` from a thread made outside the ``threading`` module:

* where distcheck's C extension is built (``_native_thread``, as the tracer's hot path: wherever a C compiler
  was at install), a native thread, as torch makes its own: not in ``threading.enumerate()`` or
  ``active_count()``, and between ticks (nearly always) with no Python thread state, so not in
  ``sys._current_frames()`` or a faulthandler dump either;
* elsewhere, a thread of ``_thread.start_new_thread``: not in ``threading.enumerate()`` or
  ``active_count()`` (a test suite's thread police never sees it), but in ``sys._current_frames()``.

Nothing the tasks run may call ``threading.current_thread()`` (it would register the thread with the
``threading`` module as a dummy thread); they use ``threading.get_ident()``. The thread stops when its last task
is removed (the generation it served ended: ``destroy_process_group``), and before the interpreter shuts down.
"""

from __future__ import annotations

import _thread
import atexit
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distcheck.rank.guard import Hook, failed

TICK_S = 0.05
STOP_WAIT_S = 2.0   # a tick under way (a counter read in torch's C++ API) is waited for, no longer


def native_thread_type() -> Any:
    """``_native_thread.NativeThread``, or None where the extension was not built (or ``DISTCHECK_HOT_PATH=python``
    asks for the pure-Python paths)."""
    if os.environ.get("DISTCHECK_HOT_PATH", "").lower() == "python":
        return None
    try:
        from distcheck.rank._native_thread import NativeThread
    except ImportError:
        return None
    return NativeThread


@dataclass
class Task:
    name: str
    run: Callable[[], None]
    every_s: float
    hook: Hook
    due: float = 0.0


class _PythonThread:
    """The fallback where the C extension is not built: the same contract as ``NativeThread``."""

    def __init__(self, tick: Callable[[], bool], interval_s: float) -> None:
        self._tick, self._interval = tick, interval_s
        self._stop = _thread.allocate_lock()   # held while the thread may run; released asks it to stop
        self._ended = _thread.allocate_lock()  # held while the thread runs
        self.ident = 0

    @property
    def running(self) -> bool:
        return self._ended.locked()

    def start(self) -> None:
        self._stop.acquire()
        self._ended.acquire()
        _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        self.ident = _thread.get_ident()
        try:
            while not self._stop.acquire(timeout=self._interval):
                try:
                    if not self._tick():
                        break
                except BaseException:   # the tick counts its own; nothing may be printed into the job's output
                    break
        finally:
            self._ended.release()

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        if self._stop.locked():
            self._stop.release()
        if self.ident == _thread.get_ident():
            return False   # from its own tick: it ends once the tick returns
        if self._ended.acquire(timeout=wait_s):
            self._ended.release()
            return True
        return False

    def forget_after_fork(self) -> None:
        self._stop, self._ended, self.ident = _thread.allocate_lock(), _thread.allocate_lock(), 0


class Ticker:
    """Due tasks, called from one thread the job cannot see; started by the first task, stopped by the last."""

    def __init__(self, interval_s: float = TICK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self._clock = interval_s, clock
        self._tasks: dict[str, Task] = {}
        self._thread: Any = None
        self._pid = 0
        self.native = native_thread_type() is not None

    def every(self, name: str, every_s: float, run: Callable[[], None], hook: Hook) -> None:
        """Call ``run`` every ``every_s`` (replacing a task of that name); its failures count against ``hook``."""
        self._tasks[name] = Task(name, run, every_s, hook)
        self._ensure_running()

    def remove(self, name: str) -> None:
        """The task is not called again (a tick under way may finish it); the thread stops with the last task."""
        self._tasks.pop(name, None)
        if not self._tasks:
            self.stop()

    def has(self, name: str) -> bool:
        return name in self._tasks

    @property
    def running(self) -> bool:
        return self._thread is not None and self._pid == os.getpid() and bool(self._thread.running)

    @property
    def ident(self) -> int:
        """The thread's ident (as ``threading.get_ident()`` says it in the thread), 0 where it has not ticked."""
        return int(self._thread.ident) if self.running else 0

    def tick(self) -> bool:
        """Run the due tasks; False ends the thread (no task left)."""
        now = self._clock()
        for task in list(self._tasks.values()):
            if now < task.due:
                continue
            task.due = now + task.every_s
            try:
                task.run()
            except Exception as exc:   # a task of distcheck's own: counted, never printed (rule 0)
                failed(task.hook, exc)
        return bool(self._tasks)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and self._pid == os.getpid():
            thread.stop(wait_s)
            atexit.unregister(_stop_before_shutdown)

    def clear(self) -> None:
        """No task left, and the thread stopped (distcheck disarmed in this process)."""
        self._tasks.clear()
        self.stop()

    def _ensure_running(self) -> None:
        if self.running:
            return
        # registered while a thread runs, so a disarmed process keeps no exit hook of ours (unregister is idempotent)
        atexit.unregister(_stop_before_shutdown)
        atexit.register(_stop_before_shutdown)
        make = native_thread_type() or _PythonThread
        self._thread, self._pid = make(self.tick, self.interval_s), os.getpid()
        self._thread.start()

    def after_fork_in_child(self) -> None:
        """A forked child has no thread of ours: its tasks are its parent's, and are dropped."""
        self._tasks.clear()
        self._thread = None


TICKER = Ticker()
os.register_at_fork(after_in_child=TICKER.after_fork_in_child)


def _stop_before_shutdown() -> None:
    # A tick inside torch's C++ API when the interpreter finalizes would abort the process ("terminate called
    # without an active exception", measured with a daemon thread reading a group's counter): stop first.
    TICKER.stop()
