"""The files a rank shares with the launcher, inside one launch directory.

The worker never coordinates through the job's process group: a distcheck
barrier would pair with the user's collectives and hide the very hang we look
for. Status and results go through these files instead (written atomically);
traces are written only at their end (see ``distcheck.files.trace``).

This module owns the layout: ``LaunchFiles`` is the one place that names a
launch dir's entries, and ``RankStatus`` is the one shape of a status file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcheck.files.trace_reader import read_trace_bytes
from distcheck.models import Phase

# Status fields that describe a rank's failure: written together, even when None.
_ERROR_FIELDS = ("exit_code", "exception", "traceback", "where")


@dataclass(frozen=True)
class RankStatus:
    """A rank's status file (``status/rank<N>.json``), rewritten by its worker on every change.

    Fields are in the order the worker first sets them, which is their order on disk.
    """

    rank: int
    pid: int | None = None
    host: str = ""
    node: int = 0
    main_thread: int | None = None           # ident of the thread that runs the job
    t_start: float | None = None
    phase: Phase | None = None
    t_update: float | None = None
    flight_recorder: bool | None = None      # serves Flight Recorder dumps on request
    pg_initialized: bool | None = None       # the job's process group exists
    current: str | None = None               # batched launch: the scenario running now
    scenarios: dict[str, Any] | None = None  # batched launch: name -> {results, collectives, t_start, t_end}
    collectives: int | None = None
    results: dict[str, Any] | None = None
    exit_code: int | None = None
    exception: str | None = None             # "Type: first line of the message"
    traceback: str | None = None
    where: str | None = None                 # file:line:function of the innermost user frame
    unwatched: str | None = None             # why C++-issued collectives were counted but not watched
    world_size: int | None = None            # ranks in the job (a rank the user's own command started says)
    backend: str | None = None               # its process group's backend (likewise)
    pg_timeout_s: float | None = None        # its default group's timeout (the backend ends the job past it)
    test: str | None = None                  # the pytest node id running when the rank initialized
    # distcheck's own hooks that failed here (rank.guard): name -> {count, error}
    hook_failures: dict[str, Any] | None = None

    @property
    def done_with_current(self) -> bool:
        """A shared launch's rank that finished its part of the scenario it runs, and waits for its peers at
        that scenario's end (the worker records it among those finished before it waits): until they come it
        issues nothing, and its record stays as it is."""
        return bool(self.current and self.scenarios and self.current in self.scenarios)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankStatus:
        """Tolerant: unknown keys are ignored, an unknown phase reads as None."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["phase"] = _phase(values.get("phase"))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object on disk: unset (None) fields are left out, except a failure's fields."""
        failed = self.exception is not None
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None or (failed and f.name in _ERROR_FIELDS)}


def _phase(value: Any) -> Phase | None:
    try:
        return Phase(value)
    except (ValueError, TypeError):
        return None


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Phase) else value


class LaunchFiles:
    """Paths of one launch (one scenario or script run)."""

    # Per-rank folders, each holding rank<N>.<ext>.
    RANK_FOLDERS = ("traces", "status", "stacks", "logs", "samples", "flight_recorder", "metrics")
    # Everything a launch dir can hold: its signature (the agent's logs and two flag files besides).
    ENTRIES = (*RANK_FOLDERS, "agent", "release", "flight_recorder_request", "generations", "tests")
    # What ``make`` creates before the ranks start.
    MADE = ("traces", "status", "stacks", "logs")
    # What another node sends node 0 for its report.
    SHIPPED = ("traces", "status", "stacks", "samples", "logs", "metrics")   # metrics: the replay's inputs

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @staticmethod
    def is_launch_dir(path: Path) -> bool:
        """Whether ``path`` holds anything a launch writes."""
        return any((path / name).exists() for name in LaunchFiles.ENTRIES)

    def has_rank_records(self) -> bool:
        """Whether ranks of this launch got as far as writing a trace or a status."""
        return self.traces.exists() or (self.root / "status").exists()

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    def trace(self, rank: int) -> Path:
        return self.traces / f"rank{rank}.trace"

    def status(self, rank: int) -> Path:
        return self.root / "status" / f"rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        return self.root / "stacks" / f"rank{rank}.txt"

    def busy_stack(self, rank: int) -> Path:
        """Where a busy rank was while others waited (taken on request, before any teardown)."""
        return self.root / "stacks" / f"rank{rank}.busy.txt"

    def terminated_stack(self, rank: int) -> Path:
        """Where the rank was when a SIGTERM ended it (faulthandler, chained to the rank's own handling)."""
        return self.root / "stacks" / f"rank{rank}.sigterm.txt"

    def stack_request(self, rank: int) -> Path:
        """The watchdog's request for this rank's stacks (``rank.stack_probe`` answers it): ``N KIND``."""
        return self.root / "stacks" / f"rank{rank}.request"

    def flight_recorder(self, rank: int) -> Path:
        return self.root / "flight_recorder" / f"rank{rank}.json"

    @property
    def flight_recorder_request(self) -> Path:
        return self.root / "flight_recorder_request"

    @property
    def metrics_dir(self) -> Path:
        """Recorded torchmetrics inputs (one folder per rank) and the replay's files."""
        return self.root / "metrics"

    def metrics(self, rank: int) -> Path:
        return self.metrics_dir / f"rank{rank}"

    def samples(self, rank: int) -> Path:
        return self.root / "samples" / f"rank{rank}.jsonl"

    def log(self, rank: int) -> Path:
        return self.root / "logs" / f"rank{rank}.log"

    @property
    def command_log(self) -> Path:
        """``run -- CMD``: what the command printed before its ranks had logs of their own."""
        return self.root / "logs" / "command.log"

    @property
    def agent_logs(self) -> Path:
        """Where torch's elastic agent writes its own logs."""
        return self.root / "agent"

    @property
    def release(self) -> Path:
        return self.root / "release"

    # -- generations: each init_process_group of the user's command starts one (see rank.injected) --

    @property
    def generations_dir(self) -> Path:
        return self.root / "generations"

    def generation(self, index: int) -> LaunchFiles:
        """Generation ``index``'s files. Generation 0 writes at the launch dir's top, so a command
        that initializes once keeps the layout of any other launch; generation N in generations/N."""
        return self if index == 0 else LaunchFiles(self.generations_dir / str(index))

    def claim_generation(self) -> int:
        """The next free generation number, claimed with an atomic mkdir (generations/N), so two
        generations starting at once never share files. Called by one rank per generation."""
        self.generations_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        index = max(self.generations(), default=-1) + 1
        while True:
            try:
                (self.generations_dir / str(index)).mkdir(mode=0o700)
                return index
            except FileExistsError:
                index += 1

    def generations(self) -> list[int]:
        """Claimed generation numbers, oldest first."""
        try:
            names = [p.name for p in self.generations_dir.iterdir()]
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    # -- the pytest test a process is running (written by distcheck's pytest plugin under run -- pytest) --

    def current_test(self, pid: int) -> Path:
        return self.root / "tests" / f"{pid}.current"

    def write_current_test(self, pid: int, nodeid: str | None) -> None:
        """What pytest process ``pid`` runs now (None: between tests); ranks it starts read it at init."""
        path = self.current_test(pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(nodeid or "", encoding="utf-8")
        os.replace(tmp, path)

    def read_current_test(self, pid: int) -> str | None:
        try:
            return self.current_test(pid).read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def make(self) -> None:
        for sub in self.MADE:
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    def trim_traces(self) -> None:
        """Cut each trace to its records once its rank is gone: a rank ends without closing its trace
        file, whose preallocated, unwritten end would otherwise stay in the run dir."""
        for path in self.traces.glob("rank*.trace"):
            try:
                used = len(read_trace_bytes(path))
                if used < path.stat().st_size:
                    os.truncate(path, used)
            except OSError:
                continue

    def shipped_contents(self) -> Iterator[tuple[str, bytes]]:
        """(path relative to the launch dir, contents) of every file another node sends node 0;
        a trace without its preallocated, unwritten end."""
        for rel, path in self.shipped_files():
            try:
                yield rel, read_trace_bytes(path) if rel.startswith("traces/") else path.read_bytes()
            except OSError:
                continue

    def shipped_files(self) -> Iterator[tuple[str, Path]]:
        """(path relative to the launch dir, path) of every file another node sends node 0."""
        for sub in self.SHIPPED:
            folder = self.root / sub
            if folder.is_dir():
                for path in sorted(folder.rglob("*")):   # metrics/ keeps one folder per rank
                    if path.is_file():
                        yield path.relative_to(self.root).as_posix(), path

    def ranks_on_disk(self) -> set[int]:
        """Ranks that left a status, stack dump or log here."""
        return {r for sub in ("status", "stacks", "logs") for r in self._ranks_in(sub)}

    def read_statuses(self) -> dict[int, RankStatus]:
        """Every rank that has written a status so far (a command's ranks are found here)."""
        found = (self.read_status(r) for r in self._ranks_in("status"))
        return {s.rank: s for s in found if s is not None}

    def _ranks_in(self, sub: str) -> set[int]:
        ranks = set()
        for p in (self.root / sub).glob("rank*.*"):
            r = p.stem.removeprefix("rank")
            if r.isdigit():
                ranks.add(int(r))
        return ranks

    def read_status(self, rank: int) -> RankStatus | None:
        """The rank's last status, or None before its first (or on an unreadable file)."""
        data = read_json(self.status(rank))
        if not isinstance(data, dict):
            return None
        return RankStatus.from_dict({"rank": rank, **data})

    def write_status(self, rank: int, status: RankStatus) -> None:
        write_json_atomic(self.status(rank), status.to_dict())


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(data)   # one C-encoded string: json.dump encodes in Python, chunk by chunk (5x slower)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
