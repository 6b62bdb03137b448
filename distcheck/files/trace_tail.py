"""Following one rank's trace while the rank still writes it: the watchdog's view (open calls, what
the rank entered, its sync record). The format is ``distcheck.files.trace``'s."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from distcheck.files.trace import (NONE, SEQ_MASK, SHARED_ASYNC, SHARED_LABEL, SHARED_MEMBERS, SLOT, SYNC_OFFSET,
                                   TAG_D, TAG_E, TAG_T, TAG_W, TAG_X, WAIT_IN, WAIT_OUT, Tables, encode_shapes,
                                   first_bad, read_sync, slot_words, text_at, used_bytes)


class OpenCall(NamedTuple):
    """A synchronous call a rank entered and has not left (yet); on a device-completed group (NCCL), a call whose
    work has not completed, whether or not it returned to Python (``returned``: the host went on meanwhile)."""

    op: str
    group: str
    seq: int
    t_enter: float
    label: str | None
    members: tuple[int, ...] = ()     # the group's ranks (a P2P pair: sender, receiver)
    signature: str = ""               # what must match across its ranks: op, shapes, dtypes, root, members
    returned: bool = False            # it returned to Python; its work waits on the device


class TraceTail:
    """Follows one rank's trace while the rank still writes it (the watchdog's view).

    Each ``read`` takes only the slots written since the last one; a record
    whose check fails (caught half-copied) or a text record not yet complete
    is left for the next read. Tolerant on purpose: a record it cannot use is
    skipped, since a live job must never fail on its own trace.
    """

    # The first read of a poll takes little: a rank's file is preallocated, its unwritten end zeros, and
    # reading 1 MB of them to find no new record cost 0.3 ms per rank and poll (a node of 8 ranks, 10 polls
    # a second: 2.5% of a core). A read that comes back full of records is followed by larger ones.
    FIRST_READ_BYTES = 16 * 1024
    READ_BYTES = 1024 * 1024      # at most this much per read
    LEFT_KEPT = 32                # blocking calls left, remembered for peers still waiting in one of them
    ASYNC_KEPT = 4096             # async calls whose handle may yet be waited on (a W record names them)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = 0                                      # E and X records so far
        self.entered: dict[str, int] = {}                     # group -> the highest seq the rank entered
        self.last_record_ns = 0                               # the newest time an E or X record carries
        self._open: dict[int, tuple[int, tuple]] = {}          # call key -> (t_enter_ns, shared), oldest first
        # (group, seq) -> signature of the newest blocking calls the rank left: a peer still waiting in one
        # of them with a signature that can never pair is a certain hang (``diagnose.waitfor``)
        self.left: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._left_calls: tuple | None = None
        # call key -> shared, of the newest async calls: a wait on one's handle (W) opens it as a blocking call
        self._async: OrderedDict[int, tuple] = OrderedDict()
        self._returned: set[int] = set()   # open calls on device-completed groups that returned to Python
        self._offset = 0
        self._tables = Tables()
        # The rank's last Y record: (wall time, recorder) — every call its groups counted before that
        # time is in the file (see the module docstring). None: no sidecar has synced (yet).
        self.sync: tuple[float, bool, int] | None = None

    @property
    def synced_at(self) -> float | None:
        return self.sync[0] if self.sync and self.sync[0] > 0 else None

    @property
    def settled(self) -> bool:
        """The sidecar synced after the newest record: what the file shows is the rank's whole state
        (no C++-issued call it made since is missing)."""
        return self.synced_at is not None and self.synced_at * 1e9 >= self.last_record_ns

    @property
    def stack_digest(self) -> int | None:
        """A digest of the main thread's stack at the last sync (progress evidence: it changes when the
        rank's Python code moves on)."""
        return self.sync[2] if self.sync else None

    @property
    def open(self) -> dict[int, OpenCall]:
        return {key: _open_call(key, t, s, key in self._returned) for key, (t, s) in self._open.items()}

    @property
    def newest_open(self) -> OpenCall | None:
        if not self._open:
            return None
        key = next(reversed(self._open))
        return _open_call(key, *self._open[key], key in self._returned)

    def read(self) -> TraceTail:
        size = self.FIRST_READ_BYTES
        while True:
            data = self._new_bytes(size)
            used = used_bytes(data)   # the records written so far; after them, the file's preallocated zeros
            n = used // SLOT
            if not n:
                return self
            done = self._take(slot_words(data, n), n)
            self._offset += done * SLOT
            if done < n or used < len(data) or len(data) < size:
                return self
            size = min(self.READ_BYTES, 4 * size)   # a rank that wrote much since: larger reads

    def _new_bytes(self, size: int) -> bytes:
        try:
            with open(self.path, "rb") as f:
                # The Y record first: a sync read before the new records can only be older than them.
                f.seek(SYNC_OFFSET)
                self.sync = read_sync(f.read(SLOT)) or self.sync
                f.seek(self._offset)
                return f.read(size)
        except OSError:
            return b""

    def _take(self, words: array, n: int) -> int:
        """Take complete records from ``words``; return how many slots were used up."""
        good = first_bad(words, 0, n)
        i = 0
        while i < good:
            b = 4 * i
            w0, w1, w2 = words[b], words[b + 1], words[b + 2]
            tag = w0 & 0xFF
            if tag == TAG_T:
                text, j = text_at(words, i, good)
                if not text.complete:
                    return i if j >= good else j   # the rest is not written yet / a broken record: skip it
                self._define(text.text())
                i = j
                continue
            if tag in (TAG_E, TAG_X, TAG_D, TAG_W):
                self.records += 1
                self.last_record_ns = max(self.last_record_ns, w2)
                self._call_record(tag, w0, w1, w2)
            i += 1
        return good

    def _call_record(self, tag: int, w0: int, w1: int, w2: int) -> None:
        """An E, X, W or D record: what the rank entered, left, waits on, and what completed."""
        opened, tables = self._open, self._tables
        if tag == TAG_X:
            call = opened.get(w1)
            if call is not None and call[1][0] in tables.device and w0 == TAG_X:
                self._returned.add(w1)   # enqueued: open until a D record says its work completed
            elif call is not None:
                del opened[w1]
                self._returned.discard(w1)
                self._remember_left(w1, call[1])
        elif tag == TAG_D:
            group = tables.groups.get(w0 >> 8 & 0xFFFFFF)
            if group is not None:
                self._completed(group[0], w1)
        elif tag == TAG_E:
            s = tables.shared.get(w0) or tables.shared_of(w0)
            if s is None:
                return
            if w1 & SEQ_MASK > self.entered.get(s[0], 0):
                self.entered[s[0]] = w1 & SEQ_MASK
            # async calls return at once, their wait is elsewhere; on a device-completed group every call
            # is open until its work completes
            if not s[2][SHARED_ASYNC] or s[0] in tables.device:
                opened[w1] = (w2, s)
            else:
                self._keep_async(w1, s)
        elif w0 in (WAIT_IN, WAIT_OUT):   # a wait on an async call's handle: blocked in that call
            call = opened.get(w1)
            if call is not None and call[1][0] in tables.device:
                return   # a wait returns at once there: the call stays open until its work completes
            if w0 == WAIT_OUT:
                opened.pop(w1, None)
            elif (s := self._async.get(w1)) is not None:
                opened[w1] = (w2, s)

    def _define(self, text: str) -> None:
        self._tables.define(text)
        if self._tables.segment is not None:   # the next scenario of a batch: its numbers restart
            self._tables = Tables()
            self.entered = {}
            self.left.clear()
            self._left_calls = None
            self._async.clear()
            self._returned.clear()

    def _completed(self, group: str, upto: int) -> None:
        """A D record: the group's calls numbered up to ``upto`` completed (whichever id their E record named it by:
        the tracer's or the C++-collective sidecar's)."""
        for key in [k for k, (_, s) in self._open.items() if s[0] == group and k & SEQ_MASK <= upto]:
            _, shared = self._open.pop(key)
            self._returned.discard(key)
            self._remember_left(key, shared)

    def _keep_async(self, key: int, shared: tuple) -> None:
        self._async[key] = shared
        if len(self._async) > self.ASYNC_KEPT:
            self._async.popitem(last=False)

    def _remember_left(self, key: int, shared: tuple) -> None:
        self.left[(shared[0], key & SEQ_MASK)] = _signature(shared[1], shared[2])
        if len(self.left) > self.LEFT_KEPT:
            self.left.popitem(last=False)
        self._left_calls = None

    @property
    def left_calls(self) -> tuple[tuple[str, int, str], ...]:
        """``left`` as (group, seq, signature) of each call, built again only when it changed (a watchdog
        reads it at every poll of every rank)."""
        if self._left_calls is None:
            self._left_calls = tuple((group, seq, sig) for (group, seq), sig in self.left.items())
        return self._left_calls


def _signature(op: str, rest: tuple) -> str:
    """What must be the same on every rank: op, shapes, dtypes, root, and the members a new_group asks for
    (``pairing_of`` reads it back)."""
    return f"{op} {encode_shapes(rest[1])} {';'.join(rest[2]) or NONE} {rest[4]} {rest[SHARED_MEMBERS]}"


def pairing_of(signature: str) -> tuple[str, str]:
    """(op, members asked for) of a signature: what decides whether two calls can pair at all."""
    parts = signature.split(" ")
    return parts[0], parts[-1]


def _open_call(key: int, t_enter_ns: int, shared: tuple, returned: bool = False) -> OpenCall:
    group, op, rest = shared
    return OpenCall(op, group, key & SEQ_MASK, t_enter_ns / 1e9, rest[SHARED_LABEL], tuple(rest[5]),
                    _signature(op, rest), returned)


def synced_at(path: Path) -> float | None:
    """The time of a trace's sync record alone (every call its rank's groups counted before it is in the
    file); None when there is none yet or it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(SYNC_OFFSET)
            sync = read_sync(f.read(SLOT))
    except OSError:
        return None
    return sync[0] if sync and sync[0] > 0 else None
