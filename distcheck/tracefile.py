"""The per-rank trace file: a compact, append-only, line-oriented format.

Each record is one line written with a single ``os.write`` to an ``O_APPEND``
file, so a rank killed mid-collective still leaves every complete record it
wrote. Repeated strings (process-group members, call sites) are written once
and referenced by key, which keeps the hot path to one short f-string.

Records (tab separated, ``-`` for "none"):

    G  group  ranks(comma separated)
    S  site-id  callsite  library-callsite  label
    E  group  seq  op  reduce_op  shapes  dtypes  device  root  async  t_enter  site-id
    X  group  seq  t_exit  error

shapes: tensors separated by ``;``, dims by ``x``, a 0-d tensor as ``()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.models import Event

NONE = "-"


def encode_shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    if not shapes:
        return NONE
    return ";".join("x".join(map(str, s)) if s else "()" for s in shapes)


def decode_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    if text == NONE or not text:
        return ()
    return tuple(() if s == "()" else tuple(int(d) for d in s.split("x")) for s in text.split(";"))


def clean(text: str | None) -> str:
    """A field value that cannot break the line format."""
    if text is None or text == "":
        return NONE
    return text.replace("\t", " ").replace("\n", " ").replace("\r", " ")


def _opt(text: str) -> str | None:
    return None if text == NONE else text


@dataclass
class RankTrace:
    """Everything one rank's trace file says."""

    rank: int
    events: list[Event] = field(default_factory=list)
    corrupt_lines: int = 0
    truncated: bool = False      # the file ended in the middle of a record

    @property
    def open_events(self) -> list[Event]:
        return [e for e in self.events if e.t_exit is None]


def parse_trace(rank: int, data: bytes | str) -> RankTrace:
    """Parse a whole trace file. Tolerates a torn last line and corrupt lines."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    trace = RankTrace(rank=rank)
    lines = text.split("\n")
    if lines and lines[-1] != "":
        trace.truncated = True
    lines = lines[:-1]  # the last element is "" or a torn record
    groups: dict[str, tuple[int, ...]] = {}
    sites: dict[str, tuple[str | None, str | None, str | None]] = {}
    enters: dict[tuple[str, int], list] = {}
    exits: dict[tuple[str, int], tuple[float, str | None]] = {}
    order: list[tuple[str, int]] = []
    for line in lines:
        parts = line.split("\t")
        tag = parts[0]
        try:
            if tag == "E" and len(parts) == 12:
                key = (parts[1], int(parts[2]))
                enters[key] = parts
                order.append(key)
            elif tag == "X" and len(parts) == 5:
                exits[(parts[1], int(parts[2]))] = (float(parts[3]), _opt(parts[4]))
            elif tag == "S" and len(parts) == 5:
                sites[parts[1]] = (_opt(parts[2]), _opt(parts[3]), _opt(parts[4]))
            elif tag == "G" and len(parts) == 3:
                groups[parts[1]] = tuple(int(r) for r in parts[2].split(",")) if parts[2] != NONE else ()
            else:
                trace.corrupt_lines += 1
        except ValueError:
            trace.corrupt_lines += 1
    no_site = (None, None, None)
    for key in order:
        p = enters[key]
        try:
            t_exit, error = exits.get(key, (None, None))
            callsite, library_callsite, label = sites.get(p[11], no_site)
            trace.events.append(Event(
                rank=rank, group=p[1], seq=int(p[2]), op=p[3], reduce_op=_opt(p[4]),
                shapes=decode_shapes(p[5]),
                dtypes=() if p[6] == NONE else tuple(p[6].split(";")),
                device=_opt(p[7]), root=None if p[8] == NONE else int(p[8]),
                group_ranks=groups.get(p[1], ()), async_op=p[9] == "1",
                t_enter=float(p[10]), t_exit=t_exit, error=error,
                callsite=callsite, library_callsite=library_callsite, label=label,
            ))
        except ValueError:
            trace.corrupt_lines += 1
    return trace


def trace_path(trace_dir: Path, rank: int) -> Path:
    return trace_dir / f"rank{rank}.trace"


def read_trace_dir(trace_dir: Path) -> dict[int, RankTrace]:
    """All rank traces in a directory, keyed by global rank."""
    traces: dict[int, RankTrace] = {}
    if not trace_dir.is_dir():
        return traces
    for path in sorted(trace_dir.glob("rank*.trace")):
        try:
            rank = int(path.stem.removeprefix("rank"))
        except ValueError:
            continue
        traces[rank] = parse_trace(rank, path.read_bytes())
    return traces


class TraceWriter:
    """Writes records for one rank. Every record is one ``os.write``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, record: str) -> None:
        os.write(self.fd, record.encode())

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
