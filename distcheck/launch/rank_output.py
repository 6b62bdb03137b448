"""The ranks' own output on distcheck's terminal, as torchrun shows it: each line of a rank's log
(``logs/rankN.log``, where the worker sends the rank's stdout and stderr) as it is written, prefixed
``[rankN]:`` like torchrun's ``--tee``/``local_ranks_filter`` output.

It only reads the logs, from distcheck's own process (a thread), so the rank's program is untouched
(rule 0) and the logs stay whole in the run dir. The lines go to a callback: the CLI prints them
through the console of its own view, so a line never splits one of distcheck's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

from distcheck.files.launch_dir import LaunchFiles

POLL_S = 0.1
_CHUNK = 1 << 16


class RankOutput(threading.Thread):
    """Follows ``logs/rank*.log`` under ``logs_dir`` until ``stop()``; each whole line goes to ``emit(rank,
    line)`` (the view leaves distcheck's own traceback frames out: ``report.frames.OwnFrames``)."""

    def __init__(self, logs_dir: Path, emit: Callable[[int | None, str], None]) -> None:
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
        super().__init__(launch_dir / "logs", emit)
        self.launch_dir = launch_dir

    def sources(self) -> list[tuple[Path, int | None]]:
        own: list[tuple[Path, int | None]] = [(LaunchFiles(self.launch_dir).command_log, None), *super().sources()]
        for logs in sorted(self.launch_dir.glob("generations/*/logs")):
            own += [(path, int(path.stem.removeprefix("rank"))) for path in sorted(logs.glob("rank*.log"))
                    if path.stem.removeprefix("rank").isdigit()]
        return own


# -- what a view folds: a launcher's report of its children's end, a rank's backend error after its peers left --

# A rank's line that torch's own excepthook already prefixed ("[rank0]: Traceback ..." under torchrun).
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
# glog's line, as torch's elastic agent writes it: "W1207 03:39:45.705000 25888 .../run.py:874] message"
_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (?P<where>\S+):\d+\] ?(?P<message>.*)$")
TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
LAUNCHER_ENDS = (CHILD_FAILED, "torch.distributed.elastic.multiprocessing.api.SignalException")
# A backend's error on a rank whose peers left (gloo's socket words, NCCL's watchdog's): a consequence, never a cause.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Watchdog caught collective operation timeout", "NCCL communicator was aborted",
             "ncclRemoteError", "remote process exited")
_PID = re.compile(r"\(pid: \d+\)")
FOLD_MARK = "lines folded"   # in the one line that stands for a launcher's report of its children's end


def shown_with_prefix(rank: int | None, line: str) -> str:
    """A rank's line as torchrun shows it, with one ``[rankN]:`` (torch's excepthook may have written its own)."""
    if rank is None or line.startswith(f"[rank{rank}]:"):
        return line
    return f"[rank{rank}]:{line}"


def bare(line: str) -> str:
    """The line without a ``[rankN]:`` prefix."""
    return _RANK_PREFIX.sub("", line, count=1)


def is_peer_gone(line: str) -> bool:
    """A backend's error that only says a peer left (a consequence of another rank's end)."""
    return any(words in line for words in PEER_GONE)


def _frame_only(line: str) -> bool:
    """A launcher's line that holds nothing but its banner's frame ('*****', a log line with no message)."""
    m = _LOG_LINE.match(line)
    message = m["message"] if m is not None else line
    return (m is not None or len(line.strip()) >= 5) and not message.strip(" *")


def _agent_line(line: str) -> bool:
    """torch's elastic agent reporting on its children ("failed (exitcode: 1) local_rank: 0 ...")."""
    m = _LOG_LINE.match(line)
    return m is not None and "/elastic/" in m["where"] and line[0] in "WE"


def _exception_line(line: str) -> bool:
    return bool(line.strip()) and not line[0].isspace() and not line.startswith((TRACEBACK, *_CHAINED))


class Ends:
    """One source's lines as a view shows them, folding what only reports an end. ``feed(line)`` gives the
    lines to show now. A traceback is held until its exception line: shown then, unless it is a launcher's
    report of its children's end (``LAUNCHER_ENDS`` with torchrun's ``====`` banner: ``folded``) or, on a
    rank, a backend error after its peers left (``PEER_GONE``: ``consequence``); those wait for ``end()``.
    A launcher's banner frames ('*****') are left out; the logs keep every line."""

    def __init__(self, launcher: bool) -> None:
        self.launcher = launcher
        self.held: list[str] = []
        self.state = ""          # "", "blank", "agent", "traceback", "banner", "folded", "consequence"
        self._rules = 0

    def feed(self, line: str) -> list[str]:
        text = bare(line)
        if self.launcher and _frame_only(text):
            self.held = [] if self.state == "blank" else self.held   # the blank line above a banner goes with it
            self.state = "" if self.state == "blank" else self.state
            return []
        if self.state == "blank":
            return self.release() + self.feed(line)
        if self.launcher and not text.strip() and not self.state:
            self.held, self.state = [line], "blank"
            return []
        if self.state == "banner":
            self.held.append(line)
            self._rules += bool(text.strip()) and not text.strip(" =")
            self.state = "folded" if self._rules >= 2 else "banner"
            return []
        if self.state == "traceback":
            self.held.append(line)
            return self._raised(text) if _exception_line(text) else []
        if self.state in ("folded", "consequence") and (not text.strip() or text.startswith(_CHAINED)):
            self.held.append(line)   # a chained traceback goes on: its last exception decides
            return []
        if text.startswith(TRACEBACK):
            shown = self._flush() if self.state in ("folded", "consequence") else []
            self.held.append(line)
            self.state = "traceback"
            return shown
        if self.launcher and _agent_line(text) and self.state in ("", "agent"):
            self.held.append(line)
            self.state = "agent"
            return []
        return [*self._flush(), line]

    def _raised(self, text: str) -> list[str]:
        if self.launcher and text.startswith(LAUNCHER_ENDS):
            self.state, self._rules = ("banner" if text.startswith(CHILD_FAILED) else "folded"), 0
            return []
        if not self.launcher and is_peer_gone(text):
            self.state = "consequence"
            return []
        return self.release()

    def release(self) -> list[str]:
        held, self.held, self.state = self.held, [], ""
        return held

    def _flush(self) -> list[str]:
        """Before a line that follows them: the held lines, a launcher's folded end as its one line."""
        folded = self.state == "folded"
        held = self.release()
        return [folded_line(held)] if folded else held

    def end(self) -> tuple[str, list[str]]:
        """At the source's end: ("folded" | "consequence", the held lines) for a view to decide on, or
        ("", lines still to show)."""
        state = "folded" if self.state == "banner" else self.state
        return (state if state in ("folded", "consequence") else ""), self.release()


def folded_line(held: list[str]) -> str:
    """The one line for a launcher's report of its children's end: what the banner says first failed."""
    text = [bare(line).strip() for line in held]
    ended = next((t for t in text if t.startswith(LAUNCHER_ENDS)), "")
    name, _, said = ended.partition(":")
    error_class = name.rpartition(".")[2]
    if error_class == "ChildFailedError":
        pairs = (t.split(":", 1) for t in text if ":" in t)
        # the root cause's: last
        fields = {k.strip(): v.strip() for k, v in pairs if k.strip() in ("rank", "exitcode")}
        title = next((t for t in text if t.endswith(" FAILED")), "")
        first = ", ".join(f"{k} {' '.join(_PID.sub('', v).split())}" for k, v in fields.items())
        said = "; ".join(filter(None, [title, f"first failure: {first}" if first else ""]))
    return f"the launcher's {error_class}: {said.strip()} ({len(held)} {FOLD_MARK}; every line in the run dir's logs)"


def folded_output(text: str) -> list[str]:
    """A launcher's output with its report of its children's end folded to one line (``folded_line``)."""
    ends, out = Ends(launcher=True), []
    for line in text.splitlines():
        out += ends.feed(line.rstrip())
    state, held = ends.end()
    return out + ([folded_line(held)] if state == "folded" else held)
