"""A rank that the user's own launch command started (``distcheck run -- CMD``).

``rank/inject/sitecustomize.py`` calls ``activate`` in every Python process the command
starts. Nothing happens until the process calls ``init_process_group``: then it knows its
global rank, and it becomes a traced rank exactly like one distcheck's worker started
(``runtime.arm``: status file, tracer, C++-collective sidecar, the stack probe
(a thread: no signal handler), Flight Recorder sidecar, DataLoader samples, Lightning
attribution). Ranks are found by the launcher from these files, not from the
processes it started.

A traced rank's end follows the worker's contract: its failure is recorded (uncaught
exception, or one ``torch.multiprocessing.spawn`` catches), and when it exits normally it
writes "finished" and idles until the watchdog releases the launch — so a rank that
finished early still looks like the healthy peer of a rank stuck in a collective.

Generations: every ``init_process_group`` starts one (a test suite spawns fresh ranks per
test, or a pool worker re-initializes under another rank). The ranks of one generation
agree on its number through their own store (``_generation``), and write into that
generation's files only (``LaunchFiles.generation``): no file is shared with another
process, and no record is read with another generation's definitions. The default group's
``destroy_process_group`` ends the process's generation: "finished", and its tracer stops; an
exception that then escapes the process (nobody handled it) is still that generation's failure.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distcheck.rank.guard import Hook, failed
from distcheck.rank.runtime import PROCESS

LAUNCH_DIR_ENV = "DISTCHECK_LAUNCH_DIR"
LAUNCHER_PID_ENV = "DISTCHECK_LAUNCHER_PID"
STALL_TIMEOUT_ENV = "DISTCHECK_STALL_TIMEOUT"   # the launch's --stall-timeout: no start-up wait of ours is longer

# Keys in the job's own store (under torch's "default_pg/" prefix): arrivals count the ranks that
# initialized on this store, the generation key names the files their generation writes.
ARRIVALS_KEY = "distcheck/arrivals"
GENERATION_KEY = "distcheck/generation"
GENERATION_WAIT_S = 60.0    # how long a rank waits for its generation's first rank to name it
PYTEST_TEST_ENV = "PYTEST_CURRENT_TEST"


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
        PROCESS.patches.finder(_PostImportHook(hooks))


def _patch_c10d(c10d: Any) -> None:
    """Before ``torch.distributed`` re-exports them: after ``init_process_group`` this process becomes a
    traced rank; destroying the default group ends its generation (a pool worker then waits for its next
    task, perhaps to come back under another rank). Through the rank's one pair of wrappers (``runtime``)."""
    if _become_rank_guarded not in PROCESS.on_init:
        PROCESS.on_init.append(_become_rank_guarded)
        PROCESS.on_destroy.append(_end_generation_guarded)
    PROCESS.wrap_process_group_calls()


def _become_rank_guarded() -> None:
    try:
        _become_rank()
    except Exception as exc:   # the user's job goes on, untraced, rather than fail on our account (rule 0)
        failed(Hook.RANK_SETUP, exc)
        sys.stderr.write(f"distcheck: could not trace this rank: {type(exc).__name__}: {exc}\n")


def _end_generation_guarded(c10d: Any, group: Any) -> None:
    if group is not None and not _is_default(c10d, group):
        return
    try:
        _end_generation()
    except Exception as exc:   # never keep the user's call from running (rule 0)
        failed(Hook.RANK_END, exc)
        sys.stderr.write(f"distcheck: could not end this rank's generation: {type(exc).__name__}: {exc}\n")


def _is_default(c10d: Any, group: Any) -> bool:
    try:
        return group is c10d.GroupMember.WORLD or group is c10d._get_default_group()
    except Exception:   # no default group (any more): nothing of ours to end
        return False


def _become_rank() -> None:
    """Right after init: trace this process as the global rank it just became, in its generation."""
    if _own_worker():
        return   # a rank of a distcheck launch inside the command (the pytest plugin): traced by that launch
    current = PROCESS.current
    if current is not None and current.ours:
        _end_generation()   # re-initialized without destroy_process_group (through a wrapper we missed)
    import multiprocessing.util

    import torch.distributed as dist

    from distcheck.files.launch_dir import LaunchFiles
    from distcheck.models import Phase
    from distcheck.rank import runtime
    from distcheck.rank.groups import default_group_facts

    rank, world = dist.get_rank(), dist.get_world_size()
    launch = LaunchFiles(Path(os.environ[LAUNCH_DIR_ENV]))
    files = launch.generation(_generation(launch, world))
    PROCESS.write_output_to(files.log(rank), launch.command_log)   # its own log, unless the command sent it elsewhere
    armed = runtime.arm(files, rank, script=True, main_thread=threading.get_ident(), command=True)
    armed.status.update(phase=Phase.RUNNING, pg_initialized=True, world_size=world, test=current_test(launch),
                        **default_group_facts())
    if PROCESS.end_hooks:
        return
    PROCESS.end_hooks = True
    PROCESS.patches.set(sys, "excepthook", _recording_excepthook(sys.excepthook))
    if not getattr(sys.exit, "__distcheck__", False):
        PROCESS.patches.set(sys, "exit", _recording_exit(sys.exit))
    # atexit for exec'd and spawned processes; multiprocessing's finalizers for forked ones,
    # which leave through os._exit and never run atexit.
    atexit.register(_at_exit)
    finalizer = multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)

    def undo() -> None:
        atexit.unregister(_at_exit)
        finalizer.cancel()
    PROCESS.patches.on_undo(undo)


def _own_worker() -> bool:
    """This process is distcheck's own rank (``python -m distcheck.rank.worker``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "distcheck.rank.worker"


def _generation(launch: Any, world: int) -> int:
    """The generation this init starts, agreed through the job's own store without a collective:
    the ranks that arrive count themselves, and the first of each ``world`` arrivals claims the
    next generation and names it to the others. A store the job re-uses keeps counting; a fresh
    store (a new TCPStore, a new FileStore per test) starts at its own first key."""
    import torch.distributed.distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
    except Exception as exc:   # a backend without a store: this rank's files are its own
        sys.stderr.write(f"distcheck: no store to agree on this rank's generation ({type(exc).__name__}: {exc}); "
                         "it is traced alone\n")
        return launch.claim_generation()
    return generation_on(store, launch, world, _start_up_wait())


def _start_up_wait() -> float:
    """How long a rank waits for its generation's first rank: never longer than the launch's stall timeout, so
    a first rank that could not name the generation costs the others no more than a stall would."""
    try:
        return min(GENERATION_WAIT_S, float(os.environ[STALL_TIMEOUT_ENV]))
    except (KeyError, ValueError):   # a launch that passed none: the default
        return GENERATION_WAIT_S


def generation_on(store: Any, launch: Any, world: int, wait_s: float = GENERATION_WAIT_S) -> int:
    """``_generation`` on a given c10d store (any: TCPStore, FileStore, HashStore)."""
    from datetime import timedelta

    try:
        arrived = int(store.add(ARRIVALS_KEY, 1)) - 1
    except Exception as exc:
        failed(Hook.RANK_SETUP, exc)
        sys.stderr.write(f"distcheck: the store did not count this rank ({type(exc).__name__}: {exc}); "
                         "it is traced alone\n")
        return launch.claim_generation()
    key = f"{GENERATION_KEY}/{arrived // world}"
    if arrived % world == 0:
        index = launch.claim_generation()
        try:
            store.set(key, str(index))
        except Exception as exc:   # the others wait for the key no longer than the stall timeout, then trace alone
            failed(Hook.RANK_SETUP, exc)
            sys.stderr.write(f"distcheck: could not name this rank's generation to the others "
                             f"({type(exc).__name__}: {exc})\n")
        return index
    try:
        store.wait([key], timedelta(seconds=wait_s))
        return int(store.get(key))
    except Exception as exc:   # a time-out of distcheck's own wait: counted like any hook failure
        failed(Hook.RANK_SETUP, exc)
        sys.stderr.write(f"distcheck: the first rank of this generation never named it within "
                         f"{wait_s:g} s ({type(exc).__name__}); this rank is traced alone\n")
        return launch.claim_generation()


def _end_generation() -> None:
    """This process's generation is over: "finished" (unless it failed), and its tracer and sidecar
    write nothing more, so a later generation's calls never land in this generation's trace."""
    from distcheck.models import Phase
    from distcheck.rank.runtime import finish_rank

    runtime = PROCESS.current
    if runtime is None or not runtime.ours:
        return
    PROCESS.current, PROCESS.ended = None, runtime
    if runtime.status.data.phase == Phase.RUNNING:
        finish_rank(runtime, {})
    PROCESS.retire(runtime)


def current_test(launch: Any) -> str | None:
    """The pytest node id this rank serves: what the nearest pytest process above it said it runs
    (distcheck's plugin writes it; a pool worker's environment is as old as the pool), else
    PYTEST_CURRENT_TEST in this process's environment ("path::test (call)")."""
    for pid in _ancestors():
        test = launch.read_current_test(pid)
        if test:
            return test
    value = os.environ.get(PYTEST_TEST_ENV, "")
    return value.rsplit(" (", 1)[0] or None


def _ancestors() -> list[int]:
    """This process's parent, grandparent, ... (read from /proc; empty elsewhere)."""
    out: list[int] = []
    pid = os.getppid()
    while pid > 1 and len(out) < 32:
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _record(exc: BaseException, exit_code: int = 1, uncaught: bool = False) -> None:
    """The rank's failure. ``uncaught``: an exception that ends the process (nobody handled it); after
    ``destroy_process_group`` it is still the ended generation's failure, with its line. An exit code
    chosen after the destroy (a test harness's skip code) is not."""
    from distcheck.models import Phase
    from distcheck.rank.runtime import flush_native, record_failure

    runtime = PROCESS.current
    if runtime is None and uncaught and not isinstance(exc, KeyboardInterrupt):
        runtime = PROCESS.ended   # its work is not over until the process ends (a clean-up in a ``finally:``)
    if runtime is None or not runtime.ours:
        return
    if runtime.status.data.phase == Phase.ERROR:
        return   # the first failure recorded is the rank's own (a harness may exit twice on its way out)
    if isinstance(exc, KeyboardInterrupt):   # Ctrl-C is not this rank's failure
        runtime.status.update(phase=Phase.INTERRUPTED, collectives=runtime.tracer.count)
    else:
        flush_native(runtime, exc)   # its C++-issued calls are in the trace before it counts as failed
        record_failure(runtime.status, exc, runtime.tracer.count, exit_code=exit_code)


def _recording_excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
        try:
            _record(exc, uncaught=True)
        except Exception as err:   # the user's traceback is printed all the same (rule 0)
            failed(Hook.RANK_END, err)
        previous(exc_type, exc, tb)

    return excepthook


def _recording_exit(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.exit(code)`` from an ``except`` block: a test harness that catches the rank's exception
    and exits with a code of its own (``MultiProcessTestCase`` exits 10). The exception it handles
    is the rank's failure, with its line; without one, the exit code is."""
    @functools.wraps(previous)
    def exit(code: Any = None) -> None:
        try:
            failing = code not in (None, 0) and not isinstance(code, str)
            current = PROCESS.current
            if failing and current is not None and current.ours:
                handled = sys.exc_info()[1]
                _record(handled if handled is not None else SystemExit(code),
                        exit_code=code if isinstance(code, int) else 1)
            elif current is not None and current.ours:
                # a clean exit mid-job: where its work ended, for a hang its peers then show (rank.exit_site)
                from distcheck.rank.exit_site import exit_site_of_caller

                current.status.update(where=exit_site_of_caller(sys._getframe(1)))
        except Exception as exc:   # never keep the process from exiting as it asked (rule 0)
            failed(Hook.RANK_END, exc)
        previous(code)

    exit.__distcheck__ = True  # type: ignore[attr-defined]
    return exit


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
    PROCESS.patches.set(spawn, "_wrap", _wrap)


def _recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            try:
                _record(exc, uncaught=True)
            except Exception as err:   # the rank's own exception goes to spawn unchanged (rule 0)
                failed(Hook.RANK_END, err)
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
    from distcheck.models import Phase
    from distcheck.rank.runtime import finish_rank, wait_for_release

    runtime = PROCESS.current
    try:
        if PROCESS.exited or runtime is None or not runtime.ours:
            return
        PROCESS.exited = True
        if runtime.status.data.phase in (Phase.ERROR, Phase.INTERRUPTED):
            return
        finish_rank(runtime, {})
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and not stream.closed:
                stream.flush()
        wait_for_release(runtime.files, _launcher_alive)
    except Exception as exc:   # the process still ends as it would, nothing printed at its exit (rule 0)
        failed(Hook.RANK_END, exc)
