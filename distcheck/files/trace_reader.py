"""Reading whole trace files (the format is ``distcheck.files.trace``'s): a rank's events, a batched
launch's segments, a run dir's trace folder."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import re
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.files.trace import (SEQ_MASK, SHARED_ASYNC, SHARED_NATIVE, SLOT, TAG_C, TAG_D, TAG_E, TAG_T, TAG_X,
                                   TAG_Y,
                                   VERSION_LINE, WAIT_IN, WAIT_OUT, X_OK, Tables, Text, first_bad, slot_words, text_at,
                                   text_slots, used_bytes)
from distcheck.files.trace_window import Elided, common_window, elided_of
from distcheck.models import Event


def read_trace_bytes(path: Path) -> bytes:
    """A trace file without its unwritten end (kept: a torn last record, which readers detect)."""
    data = path.read_bytes()
    used = used_bytes(data)
    return data[:used] + data[used:].rstrip(b"\0")


@dataclass
class RankTrace:
    """Everything one rank's trace file says."""

    rank: int
    events: list[Event] = field(default_factory=list)
    corrupt_records: int = 0
    truncated: bool = False      # the file ended in the middle of a record
    # group -> the calls this copy lacks (a window of a long trace, ``files.trace_window``); empty: whole
    elided: dict[str, Elided] = field(default_factory=dict)
    # (group, seq) -> when the rank first began waiting on the handle of that async call (its W record)
    waited: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        """How many calls the rank issued: those read here, and those its window left on its node."""
        return len(self.events) + sum(e.count for e in self.elided.values())


def parse_trace(rank: int, data: bytes) -> RankTrace:
    """Parse a whole trace file. Tolerates a torn last record and records it cannot resolve.

    An async call (``isend``, ``irecv``, a ``batch_isend_irecv`` op) whose handle the rank was still waiting
    on when its trace ends (a W record in, none out) is read as a blocking call it entered when that wait
    began and never left, the rank's newest call: that is where the rank is blocked."""
    trace = RankTrace(rank=rank)
    used = used_bytes(data)
    n = used // SLOT
    words = slot_words(memoryview(data), n)
    good = first_bad(words, 0, n)
    trace.truncated = good < n or bool(data[used:].strip(b"\0"))
    tables = Tables()
    if good == 0 or not _starts_with_version(words, tables):
        trace.corrupt_records = 1 if data.strip(b"\0") else 0   # not a trace file (or one from an older distcheck)
        return trace
    with no_cycle_collection():
        parse = _Parse(trace, tables)
        parse.run(words[0:4 * good:4], words[1:4 * good:4], words[2:4 * good:4])
    trace.elided.update(elided_of(parse.tables))
    return trace


_TAG_BYTE = 0 if sys.byteorder == "little" else 7
_TEXT_RUN = re.compile(re.escape(bytes([TAG_T])) + re.escape(bytes([TAG_C])) + b"*")


def _text_runs(W0: array) -> Iterator[tuple[int, int]]:
    """(first, past the last) slot of each T slot and the C slots after it, from the slots' tags alone."""
    tags = W0.tobytes()[_TAG_BYTE::8]
    return ((m.start(), m.end()) for m in _TEXT_RUN.finditer(tags))


@functools.lru_cache(maxsize=256)
def _c_slots(n: int) -> array:
    """The first words of a text record's ``n`` C slots, in order."""
    return array("Q", [(i << 8) | TAG_C for i in range(1, n + 1)])


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Build millions of events without the cycle collector: they hold no cycles, and its passes
    over the growing heap cost more than the parsing (0.7 µs per event without, 2.5 with). Node 0's
    judgment of a job's records holds it off too (``targets.launching``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _starts_with_version(words: array, tables: Tables) -> bool:
    if words[0] & 0xFF != TAG_T:
        return False
    text, _ = text_at(words, 0, len(words) // 4)
    if text.complete:
        tables.define(text.text())
    return tables.version


class _Parse:
    """One pass over a file's slots; events are built per segment (ids restart after a B record)."""

    def __init__(self, trace: RankTrace, tables: Tables) -> None:
        self.trace = trace
        self.tables = tables
        self.enters: list[tuple] = []
        self.exits: dict[int, int] = {}
        self.errors: dict[int, str] = {}
        self.waiting: dict[int, int] = {}   # call key -> when the rank began waiting on its handle, not done yet
        self.first_wait: dict[int, int] = {}   # call key -> when the rank first began waiting on its handle
        self.done: dict[str, list[tuple[int, int]]] = {}   # device-completed group -> [(seq done up to, t_ns)]

    def run(self, W0: array, W1: array, W2: array) -> None:
        """Every slot in order. A text record's slots (a T and its C slots: a 3-D mesh's group members are
        hundreds of them per trace, most of a trace's slots at 16,384 ranks) are found and joined at C speed;
        any other slot, and a text record that is not whole and in order, goes through ``_slots``."""
        self.text: Text | None = None
        corrupt, done = 0, 0
        for start, end in _text_runs(W0):
            corrupt += self._slots(W0[done:start], W1[done:start], W2[done:start])
            corrupt += self._text_run(W0, W1, W2, start, end)
            done = end
        corrupt += self._slots(W0[done:], W1[done:], W2[done:])
        self.trace.corrupt_records += corrupt + (self.text is not None)
        self._flush()

    def _text_run(self, W0: array, W1: array, W2: array, start: int, end: int) -> int:
        """A T slot at ``start`` and the C slots after it up to ``end``; how many records were corrupt."""
        length = W0[start] >> 8
        whole = max(1, -(-length // 16))   # slots: two words of text each
        if end - start < whole or W0[start + 1:start + whole] != _c_slots(whole - 1):
            return self._slots(W0[start:end], W1[start:end], W2[start:end])   # not whole, or out of order
        corrupt = int(self.text is not None)   # a text record cut short by this one
        self.text = None
        words = array("Q", bytes(16 * whole))
        words[0::2], words[1::2] = W1[start:start + whole], W2[start:start + whole]
        if sys.byteorder == "big":
            words.byteswap()
        corrupt += self._text(words.tobytes()[:length].decode("utf-8", "replace"))
        return corrupt + (end - start - whole)   # C slots past a whole text belong to none

    def _slots(self, W0: array, W1: array, W2: array) -> int:
        tables, exits, enters = self.tables, self.exits, self.enters
        shared, append = tables.shared, enters.append
        text = self.text
        corrupt = 0
        for w0, w1, w2 in zip(W0, W1, W2):
            if w0 == X_OK:
                exits[w1] = w2
                continue
            s = shared.get(w0)
            if s is not None:
                append((w1, w2, s))
                continue
            tag = w0 & 0xFF
            if tag == TAG_E:
                s = tables.shared_of(w0)
                if s is None:
                    corrupt += 1
                else:
                    append((w1, w2, s))
            elif tag == TAG_X:
                exits[w1] = w2
                self.errors[w1] = tables.errors.get(w0 >> 8, "error")
            elif w0 == WAIT_IN:
                self.waiting[w1] = w2
                self.first_wait.setdefault(w1, w2)
            elif w0 == WAIT_OUT:
                self.waiting.pop(w1, None)
            elif tag == TAG_Y:
                continue
            elif tag == TAG_D:
                group = tables.groups.get(w0 >> 8 & 0xFFFFFF)
                if group is None:
                    corrupt += 1
                else:
                    self.done.setdefault(group[0], []).append((w1, w2))
            elif tag in (TAG_T, TAG_C):
                if tag == TAG_T:
                    corrupt += text is not None   # a text record cut short by the next one
                    text = Text(w0, w1, w2)
                elif text is None or not text.add(w0, w1, w2):
                    corrupt += 1
                    continue
                if text.complete:
                    corrupt += self._text(text.text())
                    text = None
                    tables = self.tables
                    shared = tables.shared
            else:
                corrupt += 1
        self.text = text
        return corrupt

    def _text(self, text: str) -> int:
        bad = self.tables.define(text)
        if self.tables.segment is not None:   # the next scenario: its ids are its own
            self._flush()
            self.tables = Tables()
        return bad

    def _flush(self) -> None:
        """Build the events of the segment read so far."""
        events = self.trace.events
        start = len(events)
        append, exits, errors, rank, new = events.append, self.exits, self.errors, self.trace.rank, tuple.__new__
        waiting, first_wait, waited = self.waiting, self.first_wait, self.trace.waited
        device = self.tables.device
        blocked = []
        for key, t, (group, op, rest) in self.enters:
            if first_wait and key in first_wait:
                waited[(group, key & SEQ_MASK)] = first_wait[key] / 1e9
            if waiting and key in waiting and rest[SHARED_ASYNC] and group not in device:   # blocked in its wait
                blocked.append(new(Event, (rank, group, key & SEQ_MASK, op, waiting[key] / 1e9, None,
                                           errors.get(key) if errors else None,
                                           *rest[:SHARED_ASYNC], False, *rest[SHARED_ASYNC + 1:])))
                continue
            t_exit = exits.get(key)
            if group in device and not (errors and key in errors):   # returned is not done: D records say when
                rest = (*rest[:-1], None if t_exit is None else t_exit / 1e9)
                t_exit = _done_at(self.done.get(group), key & SEQ_MASK)
            append(new(Event, (rank, group, key & SEQ_MASK, op, t / 1e9, None if t_exit is None else t_exit / 1e9,
                               errors.get(key) if errors else None, *rest)))
        events.extend(sorted(blocked, key=_t_enter))
        if any(rest[SHARED_NATIVE] for _, _, rest in self.tables.shared.values()):
            # C++-issued calls are written when the sidecar sees them, a little after they
            # started: put them where they belong (the trace is in call order otherwise).
            events[start:] = sorted(events[start:], key=_t_enter)
        self.enters.clear()
        self.exits.clear()
        self.errors.clear()
        self.waiting.clear()
        self.first_wait.clear()
        self.done.clear()


def _done_at(marks: list[tuple[int, int]] | None, seq: int) -> int | None:
    """When the first D record that covers ``seq`` was written (marks in file order, their seqs rising)."""
    if not marks:
        return None
    i = bisect.bisect_left(marks, (seq, -1))
    return marks[i][1] if i < len(marks) else None


def _t_enter(e: Event) -> float:
    return e.t_enter


def split_segments(data: bytes) -> dict[str, bytes]:
    """A batched launch's trace cut at its ``B`` records: {scenario name: its own trace file}."""
    used = used_bytes(data)
    words = slot_words(memoryview(data), used // SLOT)
    header = text_slots(VERSION_LINE)
    segments: dict[str, bytes] = {}
    name, start = None, 0
    for i, w0 in enumerate(words[0::4]):
        if w0 & 0xFF != TAG_T:
            continue
        text, j = text_at(words, i, len(words) // 4)
        if text.complete and text.text().startswith("B\t"):
            if name is not None:
                segments[name] = header + data[start * SLOT:i * SLOT]
            tables = Tables()
            tables.define(text.text())
            name, start = tables.segment, j
    if name is not None:
        segments[name] = header + data[start * SLOT:used] + data[used:].rstrip(b"\0")
    return segments


def read_trace_dir(trace_dir: Path, *, keep: bool = False, reuse: bool = False) -> dict[int, RankTrace]:
    """All rank traces in a directory, keyed by global rank. ``keep``: hold them for one later ``reuse`` of the
    same folder, unchanged since (node 0 judges a job's traces, then draws its timeline from them: at 4,096 ranks
    reading them again was two thirds of writing the report). The traces are shared then: no reader changes one."""
    global _kept
    if not trace_dir.is_dir():
        return {}
    paths = {}
    for path in sorted(trace_dir.glob("rank*.trace")):
        with contextlib.suppress(ValueError):
            paths[int(path.stem.removeprefix("rank"))] = path
    # each file's size and mtime, only where traces are to be held or one held may be reused (a stat per rank)
    held = _kept if reuse else None
    seen = (trace_dir.resolve(), tuple(_signature(p) for p in paths.values())) if keep or held else None
    if held is not None and held[0] == seen:
        _kept = None
        return held[1]
    traces = {}
    with no_cycle_collection():
        for rank, path in paths.items():
            traces[rank] = parse_trace(rank, path.read_bytes())
        common_window(traces)   # windows of long traces: every rank compared on the calls all of them kept
    if keep:   # each trace a copy of its own: the judgment cuts a trace's events at the decision, the timeline not
        _kept = (seen, {rank: dataclasses.replace(trace) for rank, trace in traces.items()})
    return traces


def _signature(path: Path) -> tuple[str, int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (path.name, -1, -1)
    return (path.name, stat.st_size, stat.st_mtime_ns)


_kept: tuple[object, dict[int, RankTrace]] | None = None
