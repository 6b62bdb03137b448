"""The stack probe of the simulated ranks (a helper of ``cluster_scale``, not part of distcheck).

A real rank runs distcheck's ``rank.stack_probe``: a thread that reads the watchdog's stack request
(``files.stack_requests``) every 0.05 s and appends the rank's threads in faulthandler's layout. The
simulated ranks are idle processes with no such thread, so a node's teardown (``Watchdog._tear_down`` ->
``procs.request_stacks``) waited its whole 1.5 s for answers that could not come, then started py-spy on
each of them. That wait, once per node and one node after another in a worker, was the 205 s gather at
512 nodes. This thread answers for the simulated ranks as their probes would: within ``POLL_S`` of the
request, with the rank's main thread at the call it is in (the torch frame, then the synthetic script's).

Only the launch dirs it was told to watch are read (a node's, from the moment its teardown begins): 4,096
ranks' request files read 20 times a second would be the simulation's cost, not distcheck's.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

POLL_S = 0.05   # as rank.stack_probe
TORCH_FRAME = ("distributed/distributed_c10d.py", 4200)


def stack_text(callsite: str | None, function: str, thread: int) -> str:
    """A rank's main thread in faulthandler's layout, innermost first: inside torch's ``function`` called
    from ``callsite`` (``file:line:function``), or idle at the script's top when it is in no call."""
    import torch

    lines = [f"Thread 0x{thread:016x} (most recent call first):"]
    if callsite:
        file, line, caller = (callsite.split(":") + ["", ""])[:3]
        torch_file = os.path.join(os.path.dirname(torch.__file__), TORCH_FRAME[0])
        lines.append(f'  File "{torch_file}", line {TORCH_FRAME[1]} in {function}')
        lines.append(f'  File "{file}", line {line} in {caller or "step"}')
        lines.append(f'  File "{file}", line 1 in <module>')
    else:
        lines.append('  File "/synthetic/train.py", line 1 in <module>')
    return "\n".join(lines) + "\n\n"


class ProbeSim(threading.Thread):
    """Answers the stack requests of the simulated ranks of the launch dirs it watches."""

    def __init__(self, where: Callable[[int], tuple[str | None, str]]) -> None:
        super().__init__(name="probe-sim", daemon=True)
        self.where = where              # rank -> (its open call's callsite or None, torch's function)
        self._watched: list[tuple[Any, range]] = []
        self._answered: dict[Path, int] = {}
        self._lock = threading.Lock()

    def watch(self, files: Any, ranks: range) -> None:
        with self._lock:
            self._watched.append((files, ranks))

    def run(self) -> None:
        from distcheck.files.stack_requests import answer_path, read_request

        stop = threading.Event()
        while not stop.wait(POLL_S):
            with self._lock:
                watched = list(self._watched)
            for files, ranks in watched:
                for rank in ranks:
                    path = files.stack_request(rank)
                    request = read_request(path) if path.exists() else None
                    if request is None or request[0] <= self._answered.get(path, 0):
                        continue
                    number, kind = request
                    callsite, function = self.where(rank)
                    out = answer_path(files, rank, kind)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    try:
                        os.write(fd, stack_text(callsite, function, 1 + rank).encode())
                    finally:
                        os.close(fd)
                    self._answered[path] = number
