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

from distcheck.files.launch_dir import LaunchFiles

POLL_S = 0.1
_CHUNK = 1 << 16


class RankOutput(threading.Thread):
    """Follows ``logs/rank*.log`` under ``logs_dir`` until ``stop()``; each whole line goes to ``emit(rank,
    line)`` (the view leaves distcheck's own traceback frames out: ``report.frames.OwnFrames``)."""

    def __init__(self, logs_dir: Path, emit: Callable[[int, str], None]) -> None:
        super().__init__(name="distcheck-rank-output", daemon=True)
        self.logs_dir, self.emit = logs_dir, emit
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
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

    def sources(self) -> list[tuple[Path, int | None]]:
        """The logs followed, each with the rank whose lines it holds."""
        found = [(path, path.stem.removeprefix("rank")) for path in sorted(self.logs_dir.glob("rank*.log"))]
        return [(path, int(rank)) for path, rank in found if rank.isdigit()]

    def drain(self, final: bool = False) -> None:
        for path, rank in self.sources():
            while self._read(rank, path, final) == _CHUNK and final:
                pass   # the end of a launch: all of it

    def _read(self, rank: int | None, path: Path, final: bool) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read(_CHUNK)
        except OSError:
            return 0
        self._offsets[path] = self._offsets.get(path, 0) + len(data)
        text = self._partial.pop(path, b"") + data
        lines = text.split(b"\n")
        rest = lines.pop()
        if final and rest and len(data) < _CHUNK:
            lines.append(rest)   # the rank's last words, without their newline
        elif rest:
            self._partial[path] = rest
        for raw in lines:
            self.emit(rank, raw.decode("utf-8", errors="replace").rstrip("\r"))
        return len(data)


class CommandOutput(RankOutput):
    """A command's own output as it comes (``distcheck run -- CMD``): what it printed before its ranks had
    logs of their own (``logs/command.log``, shown as it is, ``rank`` None) and each generation's ranks'
    logs (the first generation's in ``logs/``, later ones' in ``generations/N/logs/``, each ``[rankK]:``)."""

    def __init__(self, launch_dir: Path, emit: Callable[[int | None, str], None]) -> None:
        super().__init__(launch_dir / "logs", emit)   # type: ignore[arg-type]
        self.launch_dir = launch_dir

    def sources(self) -> list[tuple[Path, int | None]]:
        own: list[tuple[Path, int | None]] = [(LaunchFiles(self.launch_dir).command_log, None), *super().sources()]
        for logs in sorted(self.launch_dir.glob("generations/*/logs")):
            own += [(path, int(path.stem.removeprefix("rank"))) for path in sorted(logs.glob("rank*.log"))
                    if path.stem.removeprefix("rank").isdigit()]
        return own
