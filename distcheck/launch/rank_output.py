"""The ranks' own output on distcheck's terminal, as torchrun shows it: each line of a rank's log
(``logs/rankN.log``, where the worker sends the rank's stdout and stderr) as it is written, prefixed
``[rankN]:`` like torchrun's ``--tee``/``local_ranks_filter`` output.

It only reads the logs, from distcheck's own process (a thread), so the rank's program is untouched
(rule 0) and the logs stay whole in the run dir. The lines go to a callback: the CLI prints them
through the console of its own view, so a line never splits one of distcheck's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

POLL_S = 0.1
_CHUNK = 1 << 16


class RankOutput(threading.Thread):
    """Follows ``logs/rank*.log`` under ``logs_dir`` until ``stop()``; each whole line goes to ``emit(rank,
    line)`` (the view leaves distcheck's own traceback frames out: ``report.frames.OwnFrames``)."""

    def __init__(self, logs_dir: Path, emit: Callable[[int, str], None]) -> None:
        super().__init__(name="distcheck-rank-output", daemon=True)
        self.logs_dir, self.emit = logs_dir, emit
        self._offsets: dict[int, int] = {}
        self._partial: dict[int, bytes] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(POLL_S):
            self.drain()

    def stop(self) -> None:
        """Stop following; every line written so far is emitted (a last one without its newline too)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=2)
        self.drain(final=True)

    def drain(self, final: bool = False) -> None:
        for path in sorted(self.logs_dir.glob("rank*.log")):
            rank = path.stem.removeprefix("rank")
            while rank.isdigit() and self._read(int(rank), path, final) == _CHUNK and final:
                pass   # the end of a launch: all of it

    def _read(self, rank: int, path: Path, final: bool) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(rank, 0))
                data = f.read(_CHUNK)
        except OSError:
            return 0
        self._offsets[rank] = self._offsets.get(rank, 0) + len(data)
        text = self._partial.pop(rank, b"") + data
        lines = text.split(b"\n")
        rest = lines.pop()
        if final and rest and len(data) < _CHUNK:
            lines.append(rest)   # the rank's last words, without their newline
        elif rest:
            self._partial[rank] = rest
        for raw in lines:
            self.emit(rank, raw.decode("utf-8", errors="replace").rstrip("\r"))
        return len(data)
