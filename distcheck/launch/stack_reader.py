"""A rank's stacks read from outside the process, read-only, with py-spy (``distcheck[stacks]``):
for a rank whose own stack probe cannot answer (its main thread holds the GIL in C code). py-spy
attaches the way a debugger does (ptrace rights: root, or ``kernel.yama.ptrace_scope`` 0, or
``CAP_SYS_PTRACE`` in a container) and sends the process no signal; ``--nonblocking`` reads it
without pausing it. The answer is written in faulthandler's layout, what ``files.stacks`` parses."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

READ_TIMEOUT_S = 5.0


def py_spy() -> str | None:
    return shutil.which("py-spy")


def read_all(pids: list[int], timeout_s: float = READ_TIMEOUT_S) -> dict[int, str]:
    """Each pid's threads, faulthandler's layout; a pid py-spy could not read (gone, not permitted,
    not Python) is left out. Read side by side: one slow process does not hold up the others."""
    exe = py_spy()
    if exe is None or not pids:
        return {}
    running = {pid: subprocess.Popen([exe, "dump", "--nonblocking", "--json", "--pid", str(pid)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for pid in pids}
    out: dict[int, str] = {}
    for pid, proc in running.items():
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            continue
        text = as_faulthandler_text(stdout) if proc.returncode == 0 else None
        if text:
            out[pid] = text
    return out


def as_faulthandler_text(py_spy_json: str) -> str | None:
    """py-spy's ``dump --json`` as faulthandler writes a dump: the main thread last."""
    try:
        threads: list[dict[str, Any]] = json.loads(py_spy_json)
    except ValueError:
        return None
    if not isinstance(threads, list) or not threads:
        return None
    threads = sorted(threads, key=lambda t: t.get("thread_name") == "MainThread")
    blocks = []
    for thread in threads:
        lines = [f"Thread 0x{int(thread.get('thread_id') or 0):016x} (most recent call first):"]
        for frame in thread.get("frames") or []:
            name = str(frame.get("name") or "?").rsplit(".", 1)[-1]   # faulthandler's co_name, not the qualname
            lines.append(f'  File "{frame.get("filename")}", line {frame.get("line")} in {name}')
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n"
