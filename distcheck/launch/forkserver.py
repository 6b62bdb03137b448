"""Ranks forked from a server that has imported torch once, instead of each importing it anew.

Every ``python -m distcheck.rank.worker`` imports torch: about 1 s of CPU a rank, so 4 ranks on 2
cores spend 2 s before their first collective, and a catalogue run pays it in each of its 14
launches. torch's own launcher can start a *function* entrypoint through multiprocessing's fork
server (``LaunchConfig.start_method="forkserver"``): the server imports torch once per distcheck
run, and each rank is a fork of it (measured on torch 2.13, 4 ranks: a launch's first collective at
0.2-0.35 s instead of 2.0 s). The agent, the rendezvous, the watchdog and the rank's own code are
the same; the rank's environment is set from the launcher's at fork time (``worker.run_forked``).

Only scenarios take this path, on torch 2.13 and newer (``CHECKED_FROM``). A user's script keeps a process of
its own: ``python script.py`` semantics (its own ``__main__``, its imports in its own order, environment read at
import time).

distcheck's own process imports torch too (torch's agent runs in it). Where it can, ``start_early`` makes
the server a fork of that process, taken right after torch loaded, instead of a new interpreter that
loads torch again: about 1.5 s of CPU less a run. The server is then what a new one would be (the same
modules preloaded, torch loaded under the ranks' environment, the ranks' C++ log level, unbuffered
output, default signal handlers, none of distcheck's files or sockets). Where that cannot be made so
(a torch built for GPUs, OMP_NUM_THREADS above 1, which starts a thread as torch loads, a Python whose
fork server differs), the server is started the usual way; ``DISTCHECK_FORK_SERVER=new`` always does.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from distcheck.launch import procs

START_METHOD = "forkserver"
# The torch this path has been run exactly on (the whole suite, twice). On torch 2.6 the suite found two
# differences: a SIGKILLed forked rank's signal was lost (a race since fixed for every torch: the launcher
# reads each forked rank's exit code, not only the first the agent reports), and a multi-node run whose
# other node was killed did not end (not understood yet). Older torches keep a process per rank.
CHECKED_FROM = (2, 13)
# What every rank imports before the scenario runs anyway (in this order): preloading more would
# change the order of imports against the tracer's patches, which a library that binds
# torch.distributed's functions at import would notice.
PRELOAD = ("torch", "torch.distributed", "distcheck.rank.worker")


@functools.cache
def available() -> bool:
    """Whether scenarios' ranks are forked on the installed torch (see CHECKED_FROM)."""
    from distcheck.torch_features import installed_version, release

    version = installed_version()
    return version is not None and release(version)[:2] >= CHECKED_FROM


def entrypoint(worker_args: tuple[str, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(function, args) for ``elastic_launch``; call inside the workers' environment (the server
    inherits it: what torch reads at import, OMP_NUM_THREADS and TORCH_CPP_LOG_LEVEL, comes from it)."""
    from distcheck.rank.worker import run_forked

    server = _start_server()
    # The rank's parent is the server: it dies with it (the server ends when this process does).
    env = {**os.environ, "DISTCHECK_LAUNCHER_PID": str(server)}
    return run_forked, (env, *worker_args)


def _start_server() -> int:
    """The fork server's pid, starting it on first use; it and multiprocessing's resource tracker (which
    the agent's queues and events need) outlive every launch, so the launcher's clean-up spares them."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    server = _private(multiprocessing.forkserver)._forkserver._forkserver_pid
    tracker = _private(multiprocessing.resource_tracker)._resource_tracker._pid
    for pid in (server, tracker):
        if pid:
            procs.keep(pid)
    return server


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """While ranks are forked: they skip importing this process's ``__main__`` again. multiprocessing
    does that for functions defined there; the ranks' entrypoint is in ``distcheck.rank.worker``, and a
    script without a main guard that started distcheck would start it again in every rank."""
    prepare = multiprocessing.spawn.get_preparation_data

    def without_main_module(name: str) -> dict[str, Any]:
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main_module
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = prepare


# DISTCHECK_FORK_SERVER=new: the server is always a new interpreter (to compare the two, or to rule this out).
SERVER_ENV_VAR = "DISTCHECK_FORK_SERVER"
# ``multiprocessing.forkserver.main``'s parameters on the Pythons ``start_early`` has been run on (3.10-3.13); on
# another (3.14 adds an authentication key) the server is started the usual way.
_SERVER_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
# TORCH_CPP_LOG_LEVEL as c10 reads it when torch loads (``c10::initLogging``): name or number -> level.
_CPP_LOG_LEVELS = {"INFO": 0, "0": 0, "WARNING": 1, "1": 1, "ERROR": 2, "2": 2, "FATAL": 3, "3": 3}


def start_early(torch_env: Mapping[str, str]) -> bool:
    """Load torch in this process under the ranks' environment ``torch_env`` and fork the fork server from
    it. Call before torch is imported and before any thread starts; True when the server was started so.
    Where it cannot be done as a new server would be, nothing is started here (torch may be loaded) and
    the first launch starts the server the usual way."""
    if os.environ.get(SERVER_ENV_VAR) == "new":
        return False
    if not (sys.platform.startswith("linux") and available() and "torch" not in sys.modules
            and _private(multiprocessing.forkserver)._forkserver._forkserver_pid is None and _known_server_main()):
        return False
    # torch loads here under the ranks' environment, except its C++ log level: this process keeps its own
    # (``launcher.quiet_native_warnings``), and the server is given the ranks' level below.
    from distcheck.launch.procs import environment_with

    with environment_with({k: v for k, v in torch_env.items() if k != "TORCH_CPP_LOG_LEVEL"}):
        for module in PRELOAD:
            __import__(module)
    log_level = _cpp_log_level_flag()
    if log_level is None or not _cpu_only_torch() or _threads() != 1:
        return False
    level = _CPP_LOG_LEVELS.get(torch_env.get("TORCH_CPP_LOG_LEVEL", "WARNING").strip().upper(), 1)
    _fork_server(log_level, level)
    return True


def _known_server_main() -> bool:
    import inspect

    server = _private(multiprocessing.forkserver)._forkserver
    return tuple(inspect.signature(multiprocessing.forkserver.main).parameters) == _SERVER_MAIN_PARAMETERS and all(
        hasattr(server, name) for name in ("_forkserver_address", "_forkserver_alive_fd", "_preload_modules"))


def _cpu_only_torch() -> bool:
    """A torch built without CUDA or ROCm: forking after it loaded cannot break a GPU runtime in the ranks."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _cpp_log_level_flag() -> Any:
    """c10's log level (``FLAGS_caffe2_log_level``, set from TORCH_CPP_LOG_LEVEL when torch loads), or None."""
    import ctypes

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


def _threads() -> int:
    """This process's threads, as the kernel counts them (a fork copies only the calling one)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _fork_server(log_level: Any, level: int) -> None:
    """What ``multiprocessing.forkserver.ForkServer.ensure_running`` does, with a fork of this process in place
    of a new interpreter."""
    server = _private(multiprocessing.forkserver)._forkserver
    multiprocessing.resource_tracker.ensure_running()
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX)
    address = _private(multiprocessing.connection).arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not multiprocessing.util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the server
        try:
            _become_server(listener.fileno(), alive_r, log_level, level)
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    server._preload_modules = list(PRELOAD)


def _become_server(listener_fd: int, alive_r: int, log_level: Any, level: int) -> None:
    import io

    from distcheck.rank import worker

    keep = {0, 1, 2, listener_fd, alive_r}
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_level.value = level
    # PYTHONUNBUFFERED, as every rank has it (typeshed declares sys.__stdout__ and __stderr__ Final; here they are new)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(  # type: ignore[misc]
        io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding, errors=sys.stdout.errors, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(  # type: ignore[misc]
        io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding, errors="backslashreplace", write_through=True)
    worker._SERVER_ENV = dict(os.environ)
    multiprocessing.forkserver.main(listener_fd, alive_r, list(PRELOAD))


def _private(module: ModuleType) -> Any:
    """``module``, for its private state (multiprocessing's: its fork server's, its resource tracker's), which
    typeshed does not declare."""
    return module
