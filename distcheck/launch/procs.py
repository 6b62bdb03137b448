"""Process hygiene: stack requests, SIGTERM → grace → SIGKILL of whole trees."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil


def is_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def request_stacks(pids: dict[int, int], stack_file: Callable[[int], Path], wait_s: float = 1.5) -> None:
    """SIGUSR1 every live rank (faulthandler dumps all threads) and wait for the dumps."""
    before: dict[int, int] = {}
    for rank, pid in pids.items():
        if not is_alive(pid):
            continue
        path = stack_file(rank)
        before[rank] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            before.pop(rank, None)
    deadline = time.monotonic() + wait_s
    pending = dict(before)
    while pending and time.monotonic() < deadline:
        for rank, size in list(pending.items()):
            path = stack_file(rank)
            if path.exists() and path.stat().st_size > size:
                pending.pop(rank)
        time.sleep(0.02)
    if len(pending) < len(before):
        time.sleep(0.05)   # let the last writers finish their lines


def terminate(processes: Iterable[psutil.Process], grace_s: float = 2.0) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL what is left. Returns the pids signalled."""
    procs = [p for p in processes if p.pid != os.getpid()]
    signalled = []
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
            signalled.append(p.pid)
        except psutil.Error:
            pass
    alive = _wait_gone(procs, grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(alive, 2.0)
    return signalled


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes are dead (zombies count) and return those still alive.

    Never reaps: the ranks are the launcher's own children, and a child reaped here
    would read as exit code 0 to the launcher's ``Popen.poll()`` (ECHILD), so a rank
    killed in a stall teardown would count as a success (and make the launcher wait
    out torch's 300 s exit barrier for the other nodes).
    """
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _running(p)]
    return alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE   # is_running: not a reused pid
    except psutil.Error:
        return False


def terminate_tree(root_pids: Iterable[int], grace_s: float = 2.0) -> list[int]:
    """Terminate the given processes and everything below them."""
    procs: dict[int, psutil.Process] = {}
    for pid in root_pids:
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            continue
        procs[p.pid] = p
        for child in descendants(pid):
            procs[child.pid] = child
    return terminate(procs.values(), grace_s)


def kill_descendants(grace_s: float = 2.0) -> list[int]:
    """The last line of defence: no process this launcher started survives it."""
    return terminate(descendants(), grace_s)


def wait_for_files(paths: Iterable[Path], timeout_s: float) -> None:
    """Until every path exists or the deadline passes (ranks answering a dump request)."""
    pending = list(paths)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.exists()]
        if pending:
            time.sleep(0.02)


def processes_mentioning(path: str) -> list[psutil.Process]:
    """Live processes (not this one) with ``path``, or a path below it, as a command-line argument."""
    below = path.rstrip(os.sep) + os.sep
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            args = p.info["cmdline"] or []
        except psutil.Error:
            continue
        if p.pid != os.getpid() and any(a == path or a.startswith(below) for a in args) and is_alive(p.pid):
            found.append(p)
    return found
