"""A rank that the user's own launch command started (``distcheck run -- CMD``).

``rank/inject/sitecustomize.py`` calls ``activate`` in every Python process the command
starts. Nothing happens until the process calls ``init_process_group``: then it knows its
global rank, and it becomes a traced rank exactly like one distcheck's worker started
(``worker.trace_rank``: status file, tracer, C++-collective sidecar, stack dumps on
SIGUSR1/SIGUSR2/SIGTERM, Flight Recorder sidecar, DataLoader samples, Lightning
attribution). Ranks are found by the launcher from these files, not from the
processes it started.

A traced rank's end follows the worker's contract: its failure is recorded (uncaught
exception, or one ``torch.multiprocessing.spawn`` catches), and when it exits normally it
writes "finished" and idles until the watchdog releases the launch — so a rank that
finished early still looks like the healthy peer of a rank stuck in a collective.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

LAUNCH_DIR_ENV = "DISTCHECK_LAUNCH_DIR"
LAUNCHER_PID_ENV = "DISTCHECK_LAUNCHER_PID"

_RUNTIME: Any = None        # worker.RankRuntime once this process became a rank
_ENDED = False


def activate() -> None:
    """Arm the hooks; cheap (torch is imported by the user's code, not here)."""
    from distcheck.rank.integrations import _PostImportHook

    hooks: dict[str, Callable[[Any], None]] = {
        "torch.distributed.distributed_c10d": _patch_c10d,
        "torch.multiprocessing.spawn": _patch_spawn,
    }
    for name, hook in list(hooks.items()):
        if name in sys.modules:   # a fork of a process that already imported it
            hook(sys.modules[name])
            del hooks[name]
    if hooks:
        sys.meta_path.insert(0, _PostImportHook(hooks))


def _patch_c10d(c10d: Any) -> None:
    """Wrap ``init_process_group`` before ``torch.distributed`` re-exports it."""
    original = c10d.init_process_group
    if getattr(original, "__distcheck__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            _become_rank()
        except Exception as exc:   # the user's job goes on, untraced, rather than fail on our account
            sys.stderr.write(f"distcheck: could not trace this rank: {type(exc).__name__}: {exc}\n")
        return result

    init_process_group.__distcheck__ = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group


def _become_rank() -> None:
    """Right after init: trace this process as the global rank it just became."""
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.status.data.pid == os.getpid():
        return   # a second process group: the first one's rank keeps its files
    import multiprocessing.util

    import torch.distributed as dist

    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.models import Phase
    from distcheck.rank import worker

    rank, world = dist.get_rank(), dist.get_world_size()
    files = LaunchFiles(Path(os.environ[LAUNCH_DIR_ENV]))
    worker.redirect_output(files.log(rank))   # from here on, this rank's output is its own log
    runtime = worker.trace_rank(files, rank, script=True, main_thread=threading.get_ident())
    runtime.status.update(phase=Phase.RUNNING, pg_initialized=True, world_size=world,
                          backend=str(dist.get_backend()))
    _RUNTIME = runtime
    sys.excepthook = _recording_excepthook(sys.excepthook)
    # atexit for exec'd and spawned processes; multiprocessing's finalizers for forked ones,
    # which leave through os._exit and never run atexit.
    atexit.register(_at_exit)
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)


def _record(exc: BaseException) -> None:
    from distcheck.models import Phase
    from distcheck.rank import worker

    runtime = _RUNTIME
    if runtime is None or runtime.status.data.pid != os.getpid():
        return
    if isinstance(exc, KeyboardInterrupt):   # Ctrl-C is not this rank's failure
        runtime.status.update(phase=Phase.INTERRUPTED, collectives=runtime.tracer.count)
    else:
        worker.record_failure(runtime.status, exc, runtime.tracer.count, exit_code=1)


def _recording_excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
        try:
            _record(exc)
        finally:
            previous(exc_type, exc, tb)

    return excepthook


def _patch_spawn(spawn: Any) -> None:
    """``mp.spawn`` catches its ranks' exceptions (to send them to the parent): record them first.

    The wrapper keeps ``_wrap``'s name, so the parent pickles it by reference and the child,
    which imports the patched module, runs it.
    """
    original = getattr(spawn, "_wrap", None)
    if original is None or getattr(original, "__distcheck__", False):
        return

    @functools.wraps(original)
    def _wrap(fn: Callable[..., Any], *rest: Any) -> Any:
        return original(_recording(fn), *rest)

    _wrap.__distcheck__ = True  # type: ignore[attr-defined]
    spawn._wrap = _wrap


def _recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            _record(exc)
            raise

    return run


def _launcher_alive() -> bool:
    try:
        os.kill(int(os.environ[LAUNCHER_PID_ENV]), 0)
    except (KeyError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _at_exit() -> None:
    """The rank's normal end: "finished", then idle until the watchdog releases the launch."""
    global _ENDED
    from distcheck.models import Phase
    from distcheck.rank import worker

    runtime = _RUNTIME
    if _ENDED or runtime is None or runtime.status.data.pid != os.getpid():
        return
    _ENDED = True
    if runtime.status.data.phase in (Phase.ERROR, Phase.INTERRUPTED):
        return
    worker.finish_rank(runtime, {})
    sys.stdout.flush()
    sys.stderr.flush()
    worker.wait_for_release(runtime.files, _launcher_alive)
