"""Reading the stack dumps that faulthandler writes in each rank."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distcheck.rank.callsite import USER, classify_file
from distcheck.models import StackFrame

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


def user_top(frames: list[StackFrame], torch_dir: str = "/torch/") -> StackFrame | None:
    """The innermost frame of the user's code (or the innermost frame at all)."""
    for frame in frames:
        if classify_file(frame.file, torch_dir) == USER:
            return frame
    return frames[0] if frames else None
