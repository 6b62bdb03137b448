"""Where every thread of this rank is, on the watchdog's request, without a signal: a task of the rank's one
thread of distcheck's (``rank.ticker``, which the job cannot see) polls the rank's stack request
(``files.stack_requests``) and appends the answer in faulthandler's text layout (what ``files.stacks`` parses).

A signal would do it from C, but whatever handler the user's code installs after
``init_process_group`` (Lightning's Slurm auto-requeue on SIGUSR1, a handler of the user's own)
would replace ours, and distcheck would then fire theirs. A collective releases the GIL while it
waits, so this thread runs while the rank is stuck in one; a rank that holds the GIL in C code does
not answer, and the watchdog reads it from outside instead (``launch.procs.request_stacks``).
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType

from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stack_requests import answer_path, read_request
from distcheck.rank.guard import Hook
from distcheck.rank.ticker import TICKER, Ticker

POLL_S = 0.05
MAX_FRAMES = 100   # per thread, as faulthandler


def thread_text(ident: int, frame: FrameType | None) -> str:
    """One thread as faulthandler writes it: innermost frame first."""
    lines = [f"Thread 0x{ident:016x} (most recent call first):"]
    depth = 0
    while frame is not None and depth < MAX_FRAMES:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        frame, depth = frame.f_back, depth + 1
    if frame is not None:
        lines.append("  ...")
    return "\n".join(lines)


def all_threads_text(main_ident: int | None, skip: int | None = None) -> str:
    """Every thread but ``skip``, the main thread last (where faulthandler puts the current one)."""
    frames = sys._current_frames()
    order = sorted((i for i in frames if i != skip), key=lambda i: i == main_ident)
    return "\n\n".join(thread_text(i, frames[i]) for i in order) + "\n\n"


class StackProbe:
    """One per process; ``aim`` points it at the files of the rank (and generation) the process is now, ``stop``
    ends its polls (the generation it served ended)."""

    TASK = "stack-probe"

    def __init__(self, ticker: Ticker = TICKER) -> None:
        self._target: tuple[LaunchFiles, int, int | None] | None = None
        self._answered: dict[str, int] = {}
        self._seen: int | None = None
        self._ticker = ticker

    def aim(self, files: LaunchFiles, rank: int, main_thread: int | None) -> None:
        self._target, self._seen = (files, rank, main_thread), None
        self._answered = {}
        self._ticker.every(self.TASK, POLL_S, self.poll, Hook.STACK_DUMPS)

    def stop(self) -> None:
        self._target = None
        self._ticker.remove(self.TASK)

    def poll(self) -> None:
        target = self._target
        if target is None:
            return
        files, rank, main_thread = target
        path = files.stack_request(rank)
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._seen:
            return
        self._seen = stamp
        request = read_request(path)
        if request is None or request[0] <= self._answered.get(str(path), 0):
            return
        number, kind = request
        text = all_threads_text(main_thread, skip=threading.get_ident())
        out = answer_path(files, rank, kind)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, text.encode("utf-8", "replace"))   # one write: a reader never sees half a dump
        finally:
            os.close(fd)
        self._answered[str(path)] = number
