"""Other work on the machine, started and ended by a test: CPU hogs that oversubscribe the cores.

A real training node is busy (8 ranks, their data-loader workers, a logger); a record that is
exact only on a quiet machine is not exact. ``cpu_hogs()`` starts busy loops, 2 per core by
default, each in its own session, and kills them all when the block ends (also on failure).
The benchmarks use it too (``benchmarks/soak.py``, ``benchmarks/detection_latency.py --load``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

# Ends by itself once its parent is gone (reparented), so a test killed from outside leaves no hog.
BUSY_LOOP = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
             "    for _ in range(100_000):\n        pass\n")


def default_hogs() -> int:
    """2x oversubscription: two busy loops per core."""
    return 2 * (os.cpu_count() or 1)


@contextlib.contextmanager
def cpu_hogs(count: int | None = None) -> Iterator[list[int]]:
    """``count`` busy Python loops (2 per core by default) for the duration of the block; yields their pids."""
    count = default_hogs() if count is None else count
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
