"""Memory facts for telling an OOM kill from any other SIGKILL.

A rank killed by SIGKILL that distcheck did not send was most often killed by
the kernel's OOM killer. Two facts make that concrete: each rank's resident
memory, sampled by the watchdog while it runs, and the OOM-kill counter of the
memory cgroup distcheck runs in (``oom_kill`` in cgroup v2's ``memory.events``
or v1's ``memory.oom_control``), read before and after a launch. The counter
counts kills of any process of the cgroup, by the global or the cgroup's own
OOM killer; it is absent outside a memory cgroup (then ``None``).

distcheck's own process is the witness that tells who was killed and why,
so the OOM killer must take a rank before it (``shield_from_oom_killer``).
The kernel can kill twice in a row — a second kill a few ms after the first,
before the victim's memory is back — and the second then takes the largest
process left, which on a small job can be distcheck. With
``CAP_SYS_RESOURCE``, distcheck lowers its own ``oom_score_adj`` by 500 and
the job keeps its own. Without it (the common case), the job's processes are
raised by the smallest step that outweighs twice distcheck's resident size
in the memory the OOM killer counts (the memory cgroup's limit, or RAM and
swap): the ranks are scored as if that much bigger, no more. Either way the
value for the job is passed down in ``DISTCHECK_JOB_OOM_SCORE_ADJ``, and
every process distcheck starts for the job (a rank, the guard of
``run -- CMD``, the metric replay) takes it first thing (``rank.oom_standing.take_job_standing``).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from distcheck.rank.oom_standing import JOB_OOM_SCORE_ADJ_ENV, OOM_SCORE_ADJ, write_oom_score_adj

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Privileged: 500 below the job puts distcheck (a few hundred MB) behind any rank, yet killable
# (-1000 would forbid the kill altogether).
OOM_SHIELD = 500
OOM_SCORE_ADJ_MIN = -999
OOM_SCORE_ADJ_MAX = 1000


_processes: dict[int, psutil.Process] = {}   # pid -> its psutil handle, made once (half a watchdog poll's cost)


def resident_bytes(pid: int | None) -> int | None:
    """The process's resident set size now, or None when it cannot be read."""
    if not pid:
        return None
    try:
        proc = _processes.get(pid)
        if proc is None:
            if len(_processes) >= 4096:
                _processes.clear()
            proc = _processes[pid] = psutil.Process(pid)
        return proc.memory_info().rss
    except psutil.Error:
        _processes.pop(pid, None)
        return None


def _memory_cgroups(pid: str = "self") -> list[tuple[Path, Path, bool]]:
    """(the hierarchy's root, the process's cgroup there, cgroup v2?) for each memory hierarchy it is in."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                   # cgroup v2
            found.append((CGROUP_ROOT, CGROUP_ROOT / path.lstrip("/"), True))
        elif "memory" in controllers.split(","):                # cgroup v1
            found.append((CGROUP_ROOT / "memory", CGROUP_ROOT / "memory" / path.lstrip("/"), False))
    return found


def _counter_files() -> list[Path]:
    return [folder / ("memory.events" if v2 else "memory.oom_control") for _, folder, v2 in _memory_cgroups()]


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


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup and of each cgroup above it (bytes)."""
    limits = []
    for root, folder, v2 in _memory_cgroups():
        for level in [folder, *folder.parents]:
            try:
                limits.append(int((level / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text()))
            except (OSError, ValueError):   # "max", or no such file at the root
                pass
            if level == root:
                break
    return limits


def oom_counted_bytes() -> int:
    """The memory the OOM killer scales ``oom_score_adj`` by: the tightest cgroup limit, or RAM + swap."""
    machine = psutil.virtual_memory().total + psutil.swap_memory().total
    return min([machine, *(b for b in _cgroup_limits() if b > 0)])


def job_oom_score_adj(own: int, own_rss: int, counted: int, may_lower: bool) -> tuple[int, int]:
    """(distcheck's value, the job's value) from distcheck's own ``oom_score_adj`` and size."""
    if may_lower:
        return max(own - OOM_SHIELD, OOM_SCORE_ADJ_MIN), own
    step = -(-2 * own_rss * 1000 // max(counted, 1))        # the ceiling: each point is counted/1000 bytes
    return own, min(own + max(step, 1), OOM_SCORE_ADJ_MAX)


def shield_from_oom_killer() -> tuple[int, int] | None:
    """Make the OOM killer take the job's processes before this one, once per process.
    Returns (distcheck's value, the job's value), or None when there is nothing to do."""
    global _job_standing
    if _job_standing is not None:      # done already (an earlier launch of this run)
        return None
    try:
        own = int(Path(OOM_SCORE_ADJ).read_text())
    except (OSError, ValueError):
        return None
    rss = resident_bytes(os.getpid())
    if rss is None:
        return None
    lowered, _ = job_oom_score_adj(own, rss, 0, may_lower=True)
    may_lower = lowered < own and write_oom_score_adj(lowered)
    mine, job = job_oom_score_adj(own, rss, oom_counted_bytes(), may_lower)
    if job == own and not may_lower:     # already at the top: nothing can put the job before distcheck
        return None
    _job_standing = str(job)
    return mine, job


_job_standing: str | None = None   # the oom_score_adj chosen for the job's processes, once chosen


def job_standing_env() -> dict[str, str]:
    """What a process started for the job needs in its environment to take its standing (``rank.oom_standing``);
    nothing is written into this process's own environment (it may be the user's: the pytest plugin)."""
    return {} if _job_standing is None else {JOB_OOM_SCORE_ADJ_ENV: _job_standing}
