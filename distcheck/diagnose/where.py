"""Where a rank is, from a stack dump it left: the user's innermost frame on its main thread. Pure (the dump
is read by ``files.stacks``; ``evidence`` and the live watchdog's ``launch.progress`` hand it here)."""

from __future__ import annotations

from typing import Any

from distcheck.files.stacks import IDLE_IN_POOL, StackDump, idle_in_pool, main_stack, user_top
from distcheck.text import call_site


def stack_top(dump: StackDump | None, main_thread: Any, torch_prefix: str = "/torch/", *,
              pool_idle: bool = True) -> str | None:
    """``file:line:function`` of the user's innermost frame on the main thread. ``pool_idle``: a pool worker
    between tasks is said as such (``IDLE_IN_POOL``), not as a place in user code."""
    if dump is None:
        return None
    thread = main_stack(dump, main_thread)
    if pool_idle and thread and idle_in_pool(thread.frames):
        return IDLE_IN_POOL
    frame = user_top(thread.frames, torch_prefix) if thread else None
    return call_site(frame.file, frame.line, frame.function) if frame else None
