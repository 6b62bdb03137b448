"""What counts as progress: the one definition that tells a *late* rank (outside every collective, making
progress: it may yet arrive) from a *stuck* one. Pure.

Every observer measures the same signs of one rank's process tree over a span of seconds and hands them here:
``run``'s watchdog (``launch.progress``, from ``launch.procs.ActivityMeter``'s counters and the rank's stack
digest, every poll) and ``attach`` (``attach.judge``, the same counters between its first and last py-spy
sample). ``analyze`` measures nothing: it reads the words the run saved (``RunFacts.late_evidence``).

A rank makes progress when, over the span, any of these holds:

* its tree used at least ``BUSY_CPU`` cores (children and data-loader workers count, and are named as its
  makers), unless that CPU is a
  device sync spinning (CUDA's default wait on an idle core: the wait itself, not work);
* its tree read or wrote at least ``IO_FLOOR_BPS`` bytes a second (files, pipes): below that it is a log
  line now and then (a heartbeat thread, a logger's flush), not work that brings the rank to the call;
* its main thread's stack moved;
* seen from outside (py-spy), its main thread was running in at least half the samples while its tree
  used at least ``RUNNING_CPU`` cores: a rank computing on a crowded node gets a few hundredths of a core;
* its main thread woke up, for an observer that keeps watching (``keeps_watching``): a socket read, which
  the byte counters miss, wakes it each time data comes (a download at zero CPU). An observer that judges
  once (attach, within seconds) cannot tell that from a loop polling with ``time.sleep``, which wakes for
  ever: there wake-ups alone are no evidence. The live watchdog's ``--busy-timeout`` bounds that case.
"""

from __future__ import annotations

from dataclasses import dataclass

from distcheck.text import size

# A rank using this much of a core is computing, not blocked: a Python loop uses ~1.0 (still ~0.3 with 4 ranks
# busy on 2 cores), a rank asleep or blocked in a C call (or idle after finishing) ~0.0, distcheck's own
# sidecars < 0.02.
BUSY_CPU = 0.1
# I/O below this rate is a log line now and then, not work: 32 idle ranks whose ticker thread logged 81 B in
# 10 s read as late, and the hang was missed.
IO_FLOOR_BPS = 1024
# With the main thread running in most samples: a starved busy rank, not a poll loop.
RUNNING_CPU = 0.01
# A sign seen this recently still counts (the live watchdog polls every fraction of a second).
RECENT_S = 1.5


@dataclass(frozen=True)
class Signs:
    """What an observer measured of one rank outside the collectives, over ``span`` seconds."""

    span: float = 0.0
    cores: float | None = None      # CPU of its process tree (None: not measured)
    io_bytes: int = 0               # bytes its tree read or wrote
    wakeups: int = 0                # times its main thread woke up
    stack_moved: bool = False       # its main thread's stack changed (from one function to another, from outside)
    running: tuple[int, int] | None = None   # (samples its main thread was running in, samples read): py-spy
    spinning: bool = False          # its CPU is a device sync's spin: the wait, not work
    child_cores: float = 0.0        # of ``cores``, its children's (data-loader workers, subprocesses)
    child_io_bytes: int = 0         # of ``io_bytes``, its children's
    children: tuple[int, ...] = ()  # the pids of the children that did it, busiest first


def progress(signs: Signs, *, keeps_watching: bool) -> str | None:
    """The evidence that the rank makes progress, in words, each sign said of the process that made it ("its
    child process 4242 read or wrote 64.0 KiB in the last 0.5 s": a data-loader worker, not the rank's main
    process); None when it shows none. ``keeps_watching``: the observer looks again (wake-ups count, see above)."""
    said = []
    cores = signs.cores if not signs.spinning else None
    if cores is not None and cores >= BUSY_CPU:
        said.append(f"{_makers(cores - signs.child_cores, signs.child_cores, BUSY_CPU / 2, signs.children)} "
                    f"used {cores:.1f} cores")
    floor = IO_FLOOR_BPS * signs.span
    if signs.io_bytes and signs.io_bytes >= floor:
        said.append(f"{_makers(signs.io_bytes - signs.child_io_bytes, signs.child_io_bytes, floor / 2, signs.children)}"
                    f" read or wrote {size(signs.io_bytes)} in the last {signs.span:.1f} s")
    if signs.running is not None and cores is not None:
        ran, seen = signs.running
        if ran and 2 * ran >= seen and cores >= RUNNING_CPU:
            said.append(f"its main thread was running in {ran} of {seen} samples ({cores:.2f} cores)")
    if keeps_watching and signs.wakeups and not said:
        said.append(f"its main thread woke {signs.wakeups} times in the last {signs.span:.1f} s")
    if signs.stack_moved:
        said.append("its stack moved")
    return ", ".join(said) or None


def _makers(own: float, children: float, floor: float, pids: tuple[int, ...]) -> str:
    """Who made a sign: the rank's main process, its children, or both (each counted past half the sign's floor,
    so one of them always is)."""
    if children < floor:
        return "its main process"
    named = (f"child process {pids[0]}" if len(pids) == 1 else
             f"child processes {', '.join(map(str, pids))}" if pids else "child processes (since ended)")
    return f"its main process and {named}" if own >= floor else f"its {named}"
