"""Memory facts for telling an OOM kill from any other SIGKILL.

A rank killed by SIGKILL that distcheck did not send was most often killed by
the kernel's OOM killer. Two facts make that concrete: each rank's resident
memory, sampled by the watchdog while it runs, and the OOM-kill counter of the
memory cgroup distcheck runs in (``oom_kill`` in cgroup v2's ``memory.events``
or v1's ``memory.oom_control``), read before and after a launch. The counter
counts kills of any process of the cgroup, by the global or the cgroup's own
OOM killer; it is absent outside a memory cgroup (then ``None``).
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def resident_bytes(pid: int | None) -> int | None:
    """The process's resident set size now, or None when it cannot be read."""
    if not pid:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def _counter_files(pid: str = "self") -> list[Path]:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "":                                   # cgroup v2
            files.append(CGROUP_ROOT / path / "memory.events")
        elif "memory" in controllers.split(","):                # cgroup v1
            files.append(CGROUP_ROOT / "memory" / path / "memory.oom_control")
    return files


def oom_kills() -> int | None:
    """OOM kills counted so far in this process's memory cgroup (None: no counter here)."""
    for path in _counter_files():
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def oom_kills_since(before: int | None) -> int | None:
    after = oom_kills()
    return None if before is None or after is None else max(0, after - before)
