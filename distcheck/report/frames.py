"""Tracebacks as the user's own: distcheck's frames left out of what a view shows. Pure text.

A rank that raised has distcheck's worker, the ``runpy`` that started the script and the tracer's
wrappers around ``torch.distributed`` on its stack. Shown as they are, a gloo error reads as if
distcheck crashed the job. Every view (terminal, JUnit, the pytest plugin's failure) shows a
traceback through ``without_own_frames``; the rank logs in the run dir keep every frame.
"""

from __future__ import annotations

import re
from pathlib import Path

import distcheck

_PACKAGE = str(Path(distcheck.__file__).resolve().parent) + "/"
_KEPT = ("builtin_scenarios/",)   # the built-in scenarios live under the package (a link): the user's reading
# '  File "/x/distcheck/rank/worker.py", line 211, in run_scenarios', after any prefix ("[rank0]:")
_FRAME = re.compile(r'^(?P<prefix>.*?)  File "(?P<path>[^"]+)", line \d+, in ')


def is_own_frame(path: str) -> bool:
    """A frame of distcheck itself (where this one is installed, or any installed copy), or of the runpy
    that ran the user's script for it; the built-in scenarios are the user's reading, so kept."""
    if path == "<frozen runpy>" or path.endswith("/runpy.py"):
        return True
    for root in (_PACKAGE, "/site-packages/distcheck/"):
        at = path.find(root)
        if at >= 0 and (root != _PACKAGE or at == 0):
            return not path[at + len(root):].startswith(_KEPT)
    return False


class OwnFrames:
    """Line by line (a rank's output as it comes): ``keep(line)`` is False for a line of a distcheck or
    runpy frame, the frame's line and the source and caret lines under it."""

    def __init__(self) -> None:
        self._skipping: str | None = None   # the prefix of the frame being left out

    def keep(self, line: str) -> bool:
        frame = _FRAME.match(line)
        if frame is not None:
            self._skipping = frame["prefix"] if is_own_frame(frame["path"]) else None
            return self._skipping is None
        if self._skipping is not None and line.startswith(self._skipping + "    "):
            return False   # the left-out frame's source line, or its ^^^^ line
        self._skipping = None
        return True


def without_own_frames(text: str) -> str:
    """``text`` with every distcheck (and runpy) frame of its tracebacks left out: the frame's line and the
    source and caret lines under it. Other lines, and other frames, are kept as they are."""
    frames = OwnFrames()
    return "\n".join(line for line in text.splitlines() if frames.keep(line))
