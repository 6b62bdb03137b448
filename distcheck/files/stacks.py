"""Stack frames: whose code a frame is in, and the dumps each rank leaves: on request, by its stack
probe (``rank.stack_probe``) or py-spy, in faulthandler's layout; on a fatal error, by faulthandler
on the rank's stderr (its log).

``classify_file`` is shared by the tracer (the call site of each collective),
the worker (where an exception was raised) and the diagnosis (where a rank
stood in its stack dump), so all three agree on what is the user's code.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.files import user_code
from distcheck.models import StackFrame

USER, LIBRARY, TORCH, SKIP = 0, 1, 2, 3

# The distcheck package (this file is distcheck/files/stacks.py): its frames are never the user's,
# except the scenarios shipped with it.
_DISTCHECK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_BUILTIN_SCENARIOS_DIR = os.path.join(_DISTCHECK_DIR, "builtin_scenarios") + os.sep


def _dirs(*names: str) -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {os.path.abspath(paths[n]) + os.sep for n in names if n in paths}
    return tuple(sorted(found))


_STDLIB_DIRS = _dirs("stdlib", "platstdlib")
_SITE_DIRS = _dirs("purelib", "platlib")
# Installed packages' console scripts (``bin/distcheck``, ``bin/torchrun``): a launcher's two lines, never where the
# user's code is (a forked scenario rank's stack starts in distcheck's own)
_SCRIPT_DIRS = _dirs("scripts")


def torch_dir() -> str:
    """torch's package directory (with a trailing separator), or ``/torch/`` while torch is not imported."""
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None) if torch is not None else None
    if file:
        return os.path.dirname(os.path.abspath(file)) + os.sep
    return os.sep + "torch" + os.sep


def classify_file(filename: str, torch_dir: str) -> int:
    """USER, LIBRARY, TORCH or SKIP (standard library, distcheck, ``<string>``) for a frame's file."""
    if filename.startswith("<"):
        return SKIP
    path = os.path.abspath(filename)
    if path.startswith(_BUILTIN_SCENARIOS_DIR) or user_code.is_named(path):   # named by the user: theirs
        return USER
    if path.startswith(_DISTCHECK_DIR):
        return SKIP
    if path.startswith(torch_dir):
        return TORCH
    if any(path.startswith(d) for d in _SITE_DIRS) or "site-packages" in path or "dist-packages" in path:
        return LIBRARY
    if any(path.startswith(d) for d in _STDLIB_DIRS) or any(path.startswith(d) for d in _SCRIPT_DIRS):
        return SKIP
    return USER

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_FATAL = re.compile(r"^Fatal Python error: (.*)$")


@dataclass
class ThreadStack:
    ident: int
    current: bool
    frames: list[StackFrame] = field(default_factory=list)   # most recent call first


@dataclass
class StackDump:
    threads: list[ThreadStack] = field(default_factory=list)
    fatal: str | None = None
    text: str = ""

    def thread(self, ident: int | None) -> ThreadStack | None:
        for t in self.threads:
            if t.ident == ident:
                return t
        return None


# faulthandler's words for the fatal signals it catches
FATAL_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                 "Floating-point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def signal_of(fatal: StackDump | None, terminated: list[StackDump]) -> str | None:
    """The signal a process's dumps say ended it: a fatal one by name (faulthandler's dump on its stderr),
    else SIGTERM where faulthandler's chained SIGTERM dump is there, else None (SIGKILL, os._exit: no word)."""
    if fatal is not None and fatal.fatal in FATAL_SIGNALS:
        return FATAL_SIGNALS[fatal.fatal]
    return "SIGTERM" if any(d.threads for d in terminated) else None


LOG_TAIL_BYTES = 262_144   # a fatal dump of every thread is a few KB, at the end of the rank's log


def fatal_dump(log: Path) -> StackDump | None:
    """The fatal-error dump faulthandler wrote to the rank's stderr (its log) as the rank died, if any."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    # the first: faulthandler dumping every thread can itself fault on a thread that runs on meanwhile, and that
    # second fatal error, written into the first dump, is not what ended the rank
    return next((d for d in parse_dumps(text) if d.fatal is not None), None)


def read_dumps(path: Path) -> list[StackDump]:
    """The dumps of a stacks file; none when it is missing or unreadable (a rank may never have dumped)."""
    try:
        return parse_dumps(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return []


def parse_dumps(text: str) -> list[StackDump]:
    """Split a file of appended faulthandler dumps into dumps."""
    dumps: list[StackDump] = []
    current: StackDump | None = None
    thread: ThreadStack | None = None
    lines: list[str] = []

    def start() -> StackDump:
        nonlocal lines
        if current is not None:
            current.text = "\n".join(lines).strip()
        lines = []
        dump = StackDump()
        dumps.append(dump)
        return dump

    for line in text.splitlines():
        fatal = _FATAL.match(line)
        head = _THREAD.match(line)
        if fatal:
            current = start()
            current.fatal = fatal.group(1)
            thread = None
        elif head:
            ident = int(head.group(2), 16)
            if current is None or current.thread(ident) is not None:
                current = start()
            thread = ThreadStack(ident=ident, current=head.group(1) == "Current thread")
            current.threads.append(thread)
        else:
            frame = _FRAME.match(line)
            if frame and thread is not None:
                thread.frames.append(StackFrame(frame.group(1), int(frame.group(2)), frame.group(3)))
        if current is not None:
            lines.append(line)
    if current is not None:
        current.text = "\n".join(lines).strip()
    return dumps


def main_stack(dump: StackDump, main_ident: int | None) -> ThreadStack | None:
    thread = dump.thread(main_ident) if main_ident is not None else None
    if thread is None and dump.threads:
        thread = dump.threads[-1]   # faulthandler lists the main thread last
    return thread


IDLE_IN_POOL = "idle: waiting for a task in a multiprocessing pool"
_POOL_WAITS = ("multiprocessing/connection.py", "multiprocessing/queues.py", "multiprocessing/synchronize.py")


def idle_in_pool(frames: list[StackFrame]) -> bool:
    """A ``multiprocessing.Pool`` worker between tasks: its loop (pool.py ``worker``) waiting in
    ``get()`` for the next task, nothing but the pool's own pipe reads inside it. Such a rank
    finished its task; it is not running user code."""
    for i, frame in enumerate(frames):
        if frame.file.endswith("multiprocessing/pool.py") and frame.function == "worker":
            inner = frames[:i]
            return bool(inner) and all(f.file.endswith(_POOL_WAITS) for f in inner)
    return False


def user_top(frames: list[StackFrame], torch_dir: str = "/torch/") -> StackFrame | None:
    """The innermost frame of the user's code (or the innermost frame at all)."""
    for frame in frames:
        if classify_file(frame.file, torch_dir) == USER:
            return frame
    return frames[0] if frames else None
