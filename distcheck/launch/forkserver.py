"""Ranks forked from a server that has imported torch once, instead of each importing it anew.

Every ``python -m distcheck.rank.worker`` imports torch: about 1 s of CPU a rank, so 4 ranks on 2
cores spend 2 s before their first collective, and a catalogue run pays it in each of its 14
launches. torch's own launcher can start a *function* entrypoint through multiprocessing's fork
server (``LaunchConfig.start_method="forkserver"``): the server imports torch once per distcheck
run, and each rank is a fork of it (measured on torch 2.13, 4 ranks: a launch's first collective at
0.2-0.35 s instead of 2.0 s). The agent, the rendezvous, the watchdog and the rank's own code are
the same; the rank's environment is set from the launcher's at fork time (``worker.run_forked``).

Only scenarios take this path, on torch 2.13 and newer (``CHECKED_FROM``). A user's script keeps a process of its own: ``python script.py``
semantics (its own ``__main__``, its imports in its own order, environment read at import time).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import os
from typing import Any, Callable, Iterator

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
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
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
