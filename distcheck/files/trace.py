"""The per-rank trace file: a compact, append-only, line-oriented format.

Each write is one ``os.write`` to an ``O_APPEND`` file, so a rank killed
mid-collective still leaves every complete record it wrote. Everything that
repeats — process-group members, call sites, whole call fingerprints — is
written once and referenced by id, so a call costs one short line on the hot
path and the parser decodes each fingerprint once, not once per call.

Records (tab separated, ``-`` for "none"):

    G  group  ranks(comma separated)
    S  site-id  callsite  library-callsite  label
    F  fp-id  op  reduce_op  shapes  dtypes  device  root  async  site-id
    E  group  seq  fp-id  t_enter_us
    X  group  seq  t_exit_us  error

Definitions (G, S, F) are written in the same ``os.write`` as the first E
record that uses them, and before it. Times are integer microseconds since the
epoch. shapes: tensors separated by ``;``, dims by ``x``, a 0-d tensor as
``()``.

The first format (12-field E records carrying the fingerprint inline, float
seconds) is still read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.models import Event

NONE = "-"
FORMAT_VERSION = 2
SEGMENT_TAG = "B"   # "B<TAB>name": a batched launch's next scenario starts here


def split_segments(data: bytes) -> dict[str, bytes]:
    """A batched launch's trace cut at its ``B`` records: {scenario name: its own trace}."""
    segments: dict[str, bytes] = {}
    name, start = None, 0
    marker = f"{SEGMENT_TAG}\t".encode()
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end + 1
        if data.startswith(marker, pos):
            if name is not None:
                segments[name] = data[start:pos]
            name, start = data[pos + len(marker):end].decode("utf-8", "replace").strip(), end
        pos = end
    if name is not None:
        segments[name] = data[start:]
    return segments


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


# Event's fields in the order parse_trace passes them (positional: cheaper than keywords).
_EVENT_ORDER = ("rank", "group", "seq", "op", "reduce_op", "shapes", "dtypes", "device", "root", "group_ranks",
                "async_op", "t_enter", "t_exit", "error", "callsite", "library_callsite", "label")
if tuple(f.name for f in dataclasses.fields(Event)) == _EVENT_ORDER:
    _make_event = Event
else:  # the model changed its field order: fall back to keywords
    def _make_event(*values):  # type: ignore[no-redef]
        return Event(**dict(zip(_EVENT_ORDER, values)))

_NO_SITE = (None, None, None)
_NO_EXIT = (None, None)


def _fingerprint(parts: list[str], sites: dict) -> tuple:
    """(op, reduce_op, shapes, dtypes, device, root, async) + site strings, from F fields 2..9."""
    return (
        parts[2], _opt(parts[3]), decode_shapes(parts[4]),
        () if parts[5] == NONE else tuple(parts[5].split(";")),
        _opt(parts[6]), None if parts[7] == NONE else int(parts[7]), parts[8] == "1",
    ) + sites.get(parts[9], _NO_SITE)


# Whole-file patterns for the fast path (a clean format-2 file): the regex engine
# splits the millions of E/X lines in C, Python only touches the fields it converts.
_E_LINE = re.compile(r"^E\t([^\t\n]*)\t([^\t\n]*)\t([^\t\n]*)\t([^\t\n]*)$", re.M)
_X_LINE = re.compile(r"^X\t([^\t\n]*)\t([^\t\n]*)\t([^\t\n]*)\t([^\t\n]*)$", re.M)
_DEF_LINE = re.compile(r"^[GSF]\t[^\n]*$", re.M)


def parse_trace(rank: int, data: bytes | str) -> RankTrace:
    """Parse a whole trace file. Tolerates a torn last line and corrupt lines."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    end = text.rfind("\n") + 1
    body = text[:end]          # complete records; anything after the last newline is a torn record
    trace = _parse_clean(rank, body)
    if trace is None:
        trace = _parse_lines(rank, body)
    trace.truncated = end != len(text)
    return trace


def _parse_clean(rank: int, body: str) -> RankTrace | None:
    """The fast path: None unless every line is a well-formed format-2 record."""
    enters = _E_LINE.findall(body)
    exit_rows = _X_LINE.findall(body)
    defs = _DEF_LINE.findall(body)
    if len(enters) + len(exit_rows) + len(defs) != body.count("\n"):
        return None            # corrupt lines or the first format: the careful path counts them
    groups: dict[str, tuple[int, ...]] = {}
    sites: dict[str, tuple[str | None, str | None, str | None]] = {}
    fps: dict[str, tuple] = {}
    try:
        for line in defs:
            parts = line.split("\t")
            tag, n = parts[0], len(parts)
            if tag == "F" and n == 10:
                fps[parts[1]] = _fingerprint(parts, sites)
            elif tag == "S" and n == 5:
                sites[parts[1]] = (_opt(parts[2]), _opt(parts[3]), _opt(parts[4]))
            elif tag == "G" and n == 3:
                groups[parts[1]] = tuple(int(r) for r in parts[2].split(",")) if parts[2] != NONE else ()
            else:
                return None
    except ValueError:
        return None
    exits = {(g, s): (t, err) for g, s, t, err in exit_rows}
    trace = RankTrace(rank=rank)
    append = trace.events.append
    no_ranks = ()
    try:
        for g, s, f, t in enters:
            fp = fps[f]
            x = exits.get((g, s))
            if x is None:
                t_exit = error = None
            else:
                t_exit, error = int(x[0]) / 1e6, (None if x[1] == NONE else x[1])
            append(_make_event(rank, g, int(s), fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], groups.get(g, no_ranks),
                               fp[6], int(t) / 1e6, t_exit, error, fp[7], fp[8], fp[9]))
    except (ValueError, KeyError):
        return None            # a field that does not convert: the careful path counts it
    return trace


def _parse_lines(rank: int, body: str) -> RankTrace:
    """The careful path: line by line, both formats, every bad line counted."""
    trace = RankTrace(rank=rank)
    lines = body.split("\n")
    lines.pop()  # the last element is ""
    groups: dict[str, tuple[int, ...]] = {}
    sites: dict[str, tuple[str | None, str | None, str | None]] = {}
    fps: dict[str, tuple] = {}
    enters: list[list[str]] = []
    exits: dict[tuple[str, str], tuple[float, str | None]] = {}
    corrupt = 0
    for line in lines:
        parts = line.split("\t")
        tag = parts[0]
        n = len(parts)
        if tag == "E" and (n == 5 or n == 12):
            enters.append(parts)
        elif tag == "X" and n == 5:
            try:
                t = parts[3]
                exits[(parts[1], parts[2])] = (int(t) / 1e6 if "." not in t else float(t),
                                               None if parts[4] == NONE else parts[4])
            except ValueError:
                corrupt += 1
        elif tag == "F" and n == 10:
            try:
                fps[parts[1]] = _fingerprint(parts, sites)
            except ValueError:
                corrupt += 1
        elif tag == "S" and n == 5:
            sites[parts[1]] = (_opt(parts[2]), _opt(parts[3]), _opt(parts[4]))
        elif tag == "G" and n == 3:
            try:
                groups[parts[1]] = tuple(int(r) for r in parts[2].split(",")) if parts[2] != NONE else ()
            except ValueError:
                corrupt += 1
        else:
            corrupt += 1
    events = trace.events
    append = events.append
    no_ranks = ()
    for p in enters:
        try:
            t_exit, error = exits.get((p[1], p[2]), _NO_EXIT)
            if len(p) == 5:
                fp = fps[p[3]]
                append(_make_event(rank, p[1], int(p[2]), fp[0], fp[1], fp[2], fp[3], fp[4], fp[5],
                                   groups.get(p[1], no_ranks), fp[6], int(p[4]) / 1e6, t_exit, error,
                                   fp[7], fp[8], fp[9]))
            else:
                callsite, library_callsite, label = sites.get(p[11], _NO_SITE)
                append(_make_event(
                    rank, p[1], int(p[2]), p[3], _opt(p[4]), decode_shapes(p[5]),
                    () if p[6] == NONE else tuple(p[6].split(";")), _opt(p[7]),
                    None if p[8] == NONE else int(p[8]), groups.get(p[1], no_ranks), p[9] == "1",
                    float(p[10]), t_exit, error, callsite, library_callsite, label))
        except (ValueError, KeyError, IndexError):
            corrupt += 1
    trace.corrupt_lines = corrupt
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
    """Writes records for one rank. Every record (with its definitions) is one ``os.write``."""

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
