"""The per-rank trace file: a compact, append-only, line-oriented format.

Each write is one ``os.write`` to an ``O_APPEND`` file, so a rank killed
mid-collective still leaves every complete record it wrote. Everything that
repeats — process-group members, call sites, whole call fingerprints — is
written once and referenced by id, so a call costs one short line on the hot
path and the parser decodes each fingerprint once, not once per call.

Records (tab separated, ``-`` for "none"):

    G  group  ranks(comma separated)
    S  site-id  callsite  library-callsite  label
    F  fp-id  op  reduce_op  shapes  dtypes  device  root  kind  site-id  splits  members
    E  group  seq  fp-id  t_enter_us
    X  group  seq  t_exit_us  error

    B  scenario-name   (a batched launch: the next scenario's own trace starts here)

kind: ``0`` a blocking call, ``1`` an async one (``async_op=True``, isend:
its wait happens elsewhere), ``n`` a call issued from C++ (DDP's reducer,
FSDP2, functional collectives: ``rank.native``), which blocks like ``0``.

Definitions (G, S, F) are written in the same ``os.write`` as the first E
record that uses them, and before it. Times are integer microseconds since the
epoch. shapes: tensors separated by ``;``, dims by ``x``, a 0-d tensor as
``()``. splits (all_to_all, all_to_all_single): elements sent to each group
rank, ``/``, elements received from each, comma separated. members (new_group):
the ranks the call asked for, comma separated.

This module is the format's one owner: the tracer writes records through the
templates and functions below, ``parse_trace`` reads a whole file and
``TraceTail`` follows a file while its rank still writes it (the watchdog).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

from distcheck.models import Event

NONE = "-"
SEGMENT_TAG = "B"   # "B<TAB>name": a batched launch's next scenario starts here

# -- writing records --------------------------------------------------------------
# The two records of every call are bytes templates the tracer fills with ``%``:
# on bytes that costs what an f-string does, where ``str.format`` plus
# ``.encode()`` would add ~0.1 µs per record to the hot path.
CALL_KEY = b"%b\t%d"               # group, seq: how the X record names its E record
ENTER = b"E\t%b\t%b\t%d\n"         # call key, fp-id, t_enter_us
EXIT_OK = b"X\t%b\t%d\t-\n"        # call key, t_exit_us
EXIT = b"X\t%b\t%d\t%b\n"          # call key, t_exit_us, error
MAX_ERROR_CHARS = 300
NATIVE = "n"                       # F's kind for a call issued from C++
F_FIELDS = 12


def group_record(group: str, ranks: Iterable[int | None]) -> bytes:
    """G: the members of a process group (or of a p2p pair); ``None`` members are left out."""
    members = ",".join(str(r) for r in ranks if r is not None)
    return f"G\t{group}\t{members or NONE}\n".encode()


def site_record(site: str, callsite: str | None, library: str | None, label: str | None) -> bytes:
    return f"S\t{site}\t{clean(callsite)}\t{clean(library)}\t{clean(label)}\n".encode()


def fingerprint_record(fp: str, op: str, reduce_op: str | None, shapes: str, dtypes: str, device: str,
                       root: int | None, is_async: bool, site: str,
                       splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                       members: tuple[int, ...] | None = None) -> bytes:
    """F: everything a traced call's E records share; ``shapes`` and ``dtypes`` already encoded."""
    return (f"F\t{fp}\t{op}\t{reduce_op or NONE}\t{shapes}\t{dtypes}\t{device}\t"
            f"{NONE if root is None else root}\t{int(is_async)}\t{site}\t{encode_splits(splits)}\t"
            f"{_ints(members)}\n").encode()


def native_fingerprint_record(fp: str, op: str, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...],
                              site: str) -> bytes:
    """F for a C++-issued call: what the Flight Recorder knows (no reduce op, device or root)."""
    return (f"F\t{fp}\t{clean(op)}\t{NONE}\t{encode_shapes(shapes)}\t{';'.join(dtypes) or NONE}\t{NONE}\t"
            f"{NONE}\t{NATIVE}\t{site}\t{NONE}\t{NONE}\n").encode()


def enter_record(key: bytes, fp: bytes, t_enter_us: int) -> bytes:
    return ENTER % (key, fp, t_enter_us)


def segment_record(name: str) -> bytes:
    return f"{SEGMENT_TAG}\t{clean(name)}\n".encode()


def exit_record(key: bytes, t_exit_us: int, exc: BaseException | None) -> bytes:
    """X for a call that returned (``exc`` None) or raised."""
    if exc is None:
        return EXIT_OK % (key, t_exit_us)
    error = clean(f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
    return EXIT % (key, t_exit_us, error.encode())


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


def _ints(values: Iterable[int] | None) -> str:
    return NONE if values is None else ",".join(map(str, values))


def _decode_ints(text: str) -> tuple[int, ...] | None:
    return None if text == NONE else tuple(int(v) for v in text.split(",") if v)


def encode_splits(splits: tuple[tuple[int, ...], tuple[int, ...]] | None) -> str:
    return NONE if splits is None else f"{_ints(splits[0])}/{_ints(splits[1])}"


def decode_splits(text: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if text == NONE:
        return None
    sent, _, received = text.partition("/")
    return _decode_ints(sent) or (), _decode_ints(received) or ()


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


# Event's fields in the order parse_trace passes them (positional: cheaper than keywords).
_EVENT_ORDER = ("rank", "group", "seq", "op", "reduce_op", "shapes", "dtypes", "device", "root", "group_ranks",
                "async_op", "t_enter", "t_exit", "error", "callsite", "library_callsite", "label", "native",
                "splits", "members")
if tuple(f.name for f in dataclasses.fields(Event)) == _EVENT_ORDER:
    _make_event = Event
else:  # the model changed its field order: fall back to keywords
    def _make_event(*values):  # type: ignore[no-redef]
        return Event(**dict(zip(_EVENT_ORDER, values)))

_NO_SITE = (None, None, None)
_T_ENTER = operator.attrgetter("t_enter")
_NO_EXIT = (None, None)


def _fingerprint(parts: list[str], sites: dict) -> tuple:
    """(op, reduce_op, shapes, dtypes, device, root, async) + site strings + (native, splits, members),
    from F fields 2..11."""
    return (
        parts[2], _opt(parts[3]), decode_shapes(parts[4]),
        () if parts[5] == NONE else tuple(parts[5].split(";")),
        _opt(parts[6]), None if parts[7] == NONE else int(parts[7]), parts[8] == "1",
    ) + sites.get(parts[9], _NO_SITE) + (parts[8] == NATIVE, decode_splits(parts[10]), _decode_ints(parts[11]))


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


def _site(parts: list[str]) -> tuple[str | None, str | None, str | None]:
    """(callsite, library callsite, label) from S fields 2..4."""
    return _opt(parts[2]), _opt(parts[3]), _opt(parts[4])


def _ranks(parts: list[str]) -> tuple[int, ...]:
    """A G record's members."""
    return tuple(int(r) for r in parts[2].split(",")) if parts[2] != NONE else ()


def _parse_clean(rank: int, body: str) -> RankTrace | None:
    """The fast path: None unless every line is a well-formed record."""
    enters = _E_LINE.findall(body)
    exit_rows = _X_LINE.findall(body)
    defs = _DEF_LINE.findall(body)
    if len(enters) + len(exit_rows) + len(defs) != body.count("\n"):
        return None            # corrupt lines: the careful path counts them
    groups: dict[str, tuple[int, ...]] = {}
    sites: dict[str, tuple[str | None, str | None, str | None]] = {}
    fps: dict[str, tuple] = {}
    try:
        if not all(_definition(line.split("\t"), groups, sites, fps) for line in defs):
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
                               fp[6], int(t) / 1e6, t_exit, error, fp[7], fp[8], fp[9], fp[10], fp[11], fp[12]))
    except (ValueError, KeyError):
        return None            # a field that does not convert: the careful path counts it
    _in_call_order(trace, fps)
    return trace


def _in_call_order(trace: RankTrace, fps: dict[str, tuple]) -> None:
    """C++-issued calls are written when the sidecar sees them, a little after they started:
    put them where they belong (the trace is in call order otherwise)."""
    if any(fp[10] for fp in fps.values()):
        trace.events.sort(key=_T_ENTER)


def _definition(parts: list[str], groups: dict, sites: dict, fps: dict) -> bool:
    """Take a G, S or F record into its table; False for anything else (ValueError: a bad field)."""
    tag, n = parts[0], len(parts)
    if tag == "F" and n == F_FIELDS:
        fps[parts[1]] = _fingerprint(parts, sites)
    elif tag == "S" and n == 5:
        sites[parts[1]] = _site(parts)
    elif tag == "G" and n == 3:
        groups[parts[1]] = _ranks(parts)
    else:
        return False
    return True


def _parse_lines(rank: int, body: str) -> RankTrace:
    """The careful path: line by line, every bad line counted."""
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
        tag, n = parts[0], len(parts)
        try:
            if tag == "E" and n == 5:
                enters.append(parts)
            elif tag == "X" and n == 5:
                exits[(parts[1], parts[2])] = (int(parts[3]) / 1e6, _opt(parts[4]))
            elif not _definition(parts, groups, sites, fps):
                corrupt += 1
        except ValueError:
            corrupt += 1
    trace = RankTrace(rank=rank)
    trace.corrupt_lines = corrupt + _add_events(trace, enters, exits, fps, groups)
    _in_call_order(trace, fps)
    return trace


def _add_events(trace: RankTrace, enters: list[list[str]], exits: dict[tuple[str, str], tuple[float, str | None]],
                fps: dict[str, tuple], groups: dict[str, tuple[int, ...]]) -> int:
    """Append an Event per E record to ``trace``; return how many E records did not resolve."""
    append = trace.events.append
    rank, bad = trace.rank, 0
    for p in enters:
        try:
            t_exit, error = exits.get((p[1], p[2]), _NO_EXIT)
            fp = fps[p[3]]
            append(_make_event(rank, p[1], int(p[2]), fp[0], fp[1], fp[2], fp[3], fp[4], fp[5],
                               groups.get(p[1], ()), fp[6], int(p[4]) / 1e6, t_exit, error, fp[7], fp[8], fp[9], fp[10],
                               fp[11], fp[12]))
        except (ValueError, KeyError):
            bad += 1
    return bad


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

    def write(self, record: bytes) -> None:
        os.write(self.fd, record)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class OpenCall(NamedTuple):
    """A synchronous call a rank entered and has not left (yet)."""

    op: str
    group: str
    seq: str
    t_enter: float
    label: str | None


class TraceTail:
    """Follows one rank's trace while the rank still writes it (the watchdog's view).

    Each ``read`` parses only what was appended since the last one; a torn last
    line waits for the rest of it. Tolerant on purpose: a record it cannot use
    is skipped, since a live job must never fail on its own trace.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = 0                                      # E and X records so far
        self.open: dict[tuple[str, str], OpenCall] = {}       # (group, seq) -> call, oldest first
        self._offset = 0
        self._partial = b""
        self._labels: dict[str, str | None] = {}              # site id -> label
        self._fps: dict[str, tuple[str, str, str]] = {}       # fp id -> (op, async flag, site id)

    @property
    def newest_open(self) -> OpenCall | None:
        return next(reversed(self.open.values())) if self.open else None

    def read(self) -> TraceTail:
        chunk = self._new_bytes()
        if chunk:
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                self._record(line.decode("utf-8", "replace").split("\t"))
        return self

    def _new_bytes(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return b""
        self._offset += len(chunk)
        return chunk

    def _record(self, parts: list[str]) -> None:
        tag, n = parts[0], len(parts)
        if tag == "E" and n == 5:
            self.records += 1
            op, is_async, site = self._fps.get(parts[3], ("?", "0", NONE))
            if is_async != "1":   # async calls return at once; their wait is elsewhere
                try:
                    t = int(parts[4]) / 1e6
                except ValueError:
                    t = time.time()
                self.open[(parts[1], parts[2])] = OpenCall(op, parts[1], parts[2], t, self._labels.get(site))
        elif tag == "X" and n >= 3:
            self.records += 1
            self.open.pop((parts[1], parts[2]), None)
        elif tag == "F" and n == F_FIELDS:
            self._fps[parts[1]] = (parts[2], parts[8], parts[9])
        elif tag == "S" and n >= 5:
            self._labels[parts[1]] = _opt(parts[4])
