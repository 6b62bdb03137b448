"""The per-rank trace file: fixed 32-byte slots in a memory-mapped file.

The tracer writes every record straight into a shared memory mapping of the
file (``TraceWriter``): no system call per record, and the page cache keeps
what was written when the process is killed, so a rank SIGKILLed inside a
collective still leaves its enter record. A slot is four little-endian
64-bit words; the fourth is a check, ``w0 ^ w1 ^ w2 ^ CHECK``, so a reader
that catches a record half-copied (or a file cut in the middle of one)
knows it and waits or stops there:

    E  w0 = 1 | group-id << 8 | fp-id << 32   w1 = call key   w2 = t_enter_ns
    X  w0 = 2 | error-id << 8 (0: none)        w1 = call key   w2 = t_exit_ns
    T  w0 = 3 | length << 8                    w1, w2 = the first 16 bytes of a text record
    C  w0 = 4 | index << 8                     w1, w2 = its next 16 bytes
    Y  w0 = 5 | flags << 8                     w1 = t_sync_ns       w2 = a digest of the main thread's stack
    W  w0 = 6 | phase << 8 (0 in, 1 out)       w1 = call key        w2 = t_ns
    D  w0 = 7 | group-id << 8                  w1 = seq             w2 = t_done_ns

D records are completion, on a group whose calls complete after they return (``G``'s completion field is
``device``: NCCL, and any backend registered from Python whose completion distcheck reads): every call of the
group numbered up to ``seq`` has completed (its backend said so; calls on one group complete in issue order, as
they run on one stream). On such a group the X record says only that the call returned to Python (its work was
enqueued): the call stays open, and the rank waits in it, until a D record covers it. On every other group (gloo)
a call is complete when it returns.

W records are a wait on an async call's handle (``work.wait()`` on what ``isend``, ``irecv`` or
``batch_isend_irecv`` returned): the call key is the async call's own, whose E and X records came
before (the call returned at once), ``in`` is written before the wait starts and ``out`` when it
returns (a wait that raised writes no ``out``: its peer died or was ended while the rank waited, and
the rank stays in that call). A rank between the two is blocked in that call, as in a blocking one.

The Y (sync) record has one fixed place, the third slot, right after the
version record, and is overwritten in place; every other record is appended.

call key = group-id << 40 | seq: the X record names its E record with it.
The file is preallocated and grown in steps; its unwritten end is zero
slots (a reader stops at the first), and ``close`` trims it.

Text records carry everything that repeats, written once and referenced by
id, one tab-separated line each (``-`` for "none"):

    V  distcheck-trace  7     (the first record of every file)
    G  group-id  group  ranks(comma separated, runs as first-last)  completion(``device`` or ``-``)
    S  site-id  callsite  library-callsite  label
    F  fp-id  op  reduce_op  shapes  dtypes  device  root  kind  site-id  splits  members
    R  error-id  "Type: message" (an error an X record names)
    B  scenario-name          (a batched launch: the next scenario's own trace starts here)
    K, H                      (a long trace's window on node 0: ``files.trace_window``)

kind: ``0`` a blocking call, ``1`` an async one (``async_op=True``, isend:
its wait happens elsewhere), ``n`` a call issued from C++ (DDP's reducer,
FSDP2, functional collectives: ``rank.native``), which blocks like ``0``.
Definitions go in the same write as, and before, the first record that uses
them; one write is one ``mmap.write``, which no other thread interleaves.
Times are integer nanoseconds since the epoch. shapes: tensors separated by
``;``, dims by ``x``, a 0-d tensor as ``()``. splits (all_to_all,
all_to_all_single): elements sent to each group rank, ``/``, elements
received from each, comma separated. members (new_group): the ranks the call
asked for, comma separated. Ids restart after a ``B`` record, so each
scenario's part parses on its own.

What is durable when (the guarantee the watchdog and the analysis build on):

* A Python-issued call: its E record is in the mapping before the backend
  sees the call, its X record right after the call returns. The page cache
  keeps both when the rank is killed (SIGKILL, SIGABRT, the OOM killer).
* A call issued from C++ (DDP's reducer and init, FSDP2, DTensor, functional
  collectives, ``Join``'s shadow calls, the P2P ops of a batch): the group
  counts it the moment it is issued; the sidecar (``rank.native``) writes its
  E record at its next poll (every 0.05 s; a Flight Recorder read at most every
  0.25 s), and then the Y record with the time it read the counters. So when
  Y says ``t``, every call any group counted before ``t`` is in the file. The
  watchdog judges a waiting or silent rank only on a record synced after its
  last change (``trace_tail.TraceTail.settled``), so a sidecar descheduled for seconds
  on a loaded node delays a verdict instead of falsifying it.
* Before a rank counts as finished or failed, and before a process group is
  destroyed, the rank flushes: every number its groups counted is written and
  closed (``NativeWatcher.flush``). A group destroyed behind the tracer's back
  is read one last time at the next poll (its counter and its Flight Recorder
  entries outlive it).
* What a rank that aborts inside a C++-issued call had not yet synced is lost
  with it; its peers' records (synced while they wait) name that call.

This module is the format's one owner: the record layout, the helpers the
tracer and the C++-collective sidecar pack records with, and what every reader
shares (the checks, the definition tables). Three modules beside it do one job
each with it: ``trace_writer`` owns the mapped file a rank writes,
``trace_reader`` reads whole files (``parse_trace``, a batch's segments, a run
dir), and ``trace_tail`` follows a file while its rank still writes it (the
watchdog's ``TraceTail``).
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Iterable

from distcheck.models import GroupKey


NONE = "-"
SLOT = 32
SLOT_STRUCT = struct.Struct("<4Q")
CHECK = 0x5D1C_7A3B_9E1F_4C65
TAG_E, TAG_X, TAG_T, TAG_C, TAG_Y, TAG_W, TAG_D = 1, 2, 3, 4, 5, 6, 7
WAIT_IN, WAIT_OUT = TAG_W, TAG_W | 1 << 8   # w0 of a W record: the wait began / ended
SYNC_OFFSET = 2 * SLOT             # the Y record's fixed place: after the version record (a T and a C slot)
SYNC_RECORDER = 1                  # a Y flag: C++-issued calls are watched (the Flight Recorder is readable)
X_OK = TAG_X                       # w0 of an X record without an error
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
FP_SHIFT = 32
NATIVE_GROUP_BASE = 1 << 23        # ids the C++-collective sidecar gives its own definitions
NATIVE_FP_BASE = 1 << 30
NATIVE = "n"                       # F's kind for a call issued from C++
F_FIELDS = 12
MAX_FIELD_CHARS = 1000
MAX_ERROR_CHARS = 300
VERSION_LINE = b"V\tdistcheck-trace\t7\n"
DEVICE = "device"                  # G's completion field: the group's calls complete after they return (D records)
_LITTLE = sys.byteorder == "little"


# -- writing records --------------------------------------------------------------


def call_key(group_id: int, seq: int) -> int:
    return group_id << SEQ_BITS | seq


def enter_word(group_id: int, fp_id: int) -> int:
    """w0 of an E record."""
    return TAG_E | group_id << 8 | fp_id << FP_SHIFT


def slot(w0: int, w1: int, w2: int) -> bytes:
    return SLOT_STRUCT.pack(w0, w1, w2, w0 ^ w1 ^ w2 ^ CHECK)


def enter_slot(group_id: int, fp_id: int, seq: int, t_enter_ns: int) -> bytes:
    return slot(enter_word(group_id, fp_id), call_key(group_id, seq), t_enter_ns)


def exit_slot(key: int, t_exit_ns: int, error_id: int = 0) -> bytes:
    return slot(TAG_X | error_id << 8, key, t_exit_ns)


def done_slot(group_id: int, seq: int, t_done_ns: int) -> bytes:
    """D: every call of the group numbered up to ``seq`` has completed (a group whose completion is the device's)."""
    return slot(TAG_D | group_id << 8, seq, t_done_ns)


def wait_slots(keys: Iterable[int], t_ns: int, out: bool) -> bytes:
    """W records: the rank begins (``out`` False) or ends waiting on the handles of these async calls."""
    w0 = WAIT_OUT if out else WAIT_IN
    return b"".join(SLOT_STRUCT.pack(w0, key, t_ns, w0 ^ key ^ t_ns ^ CHECK) for key in keys)


def sync_slot(t_sync_ns: int, stack_digest: int, recorder: bool) -> bytes:
    """The Y record: every call the rank's groups counted before ``t_sync_ns`` is in the file; the main
    thread's stack then, as a 64-bit digest."""
    return slot(TAG_Y | (SYNC_RECORDER if recorder else 0) << 8, t_sync_ns, stack_digest & (1 << 64) - 1)


def header_slots() -> bytes:
    """What a new trace file starts with: the version record, then a Y record that has synced nothing."""
    header = text_slots(VERSION_LINE) + sync_slot(0, 0, False)
    assert len(header) == SYNC_OFFSET + SLOT
    return header


def read_sync(data: bytes) -> tuple[float, bool, int] | None:
    """(t_sync in seconds, recorder, main-stack digest) of the Y record in the 32 bytes at SYNC_OFFSET;
    None if not whole."""
    if len(data) < SLOT:
        return None
    w0, w1, w2, w3 = SLOT_STRUCT.unpack_from(data)
    if w0 & 0xFF != TAG_Y or w0 ^ w1 ^ w2 ^ CHECK != w3:
        return None   # a file from before sync records, or a Y record caught half-overwritten
    return w1 / 1e9, bool(w0 >> 8 & SYNC_RECORDER), w2


def text_slots(text: bytes) -> bytes:
    """One or more text records (each a complete line) as T + C slots."""
    padded = text + b"\0" * (-len(text) % 16)
    words = [int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8)]
    out = [slot(TAG_T | len(text) << 8, words[0], words[1])]
    out += [slot(TAG_C | i << 8, words[2 * i], words[2 * i + 1]) for i in range(1, len(words) // 2)]
    return b"".join(out)


def group_record(group_id: int, group: str, ranks: Iterable[int | None], device: bool = False) -> bytes:
    """G: a process group's (or p2p pair's) id, name, members (``None`` members are left out) and whether its calls
    complete after they return (``device``: D records say when)."""
    members = encode_members(r for r in ranks if r is not None) or NONE
    return f"G\t{group_id}\t{clean(group)}\t{members}\t{DEVICE if device else NONE}\n".encode()


def encode_members(ranks: Iterable[int]) -> str:
    """A group's ranks, runs of consecutive ones as ``first-last`` ("0-4095": 9 bytes where 4,096 ranks
    written one by one were 20 KB in every rank's trace)."""
    out: list[list[int]] = []
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


@functools.lru_cache(maxsize=1024)
def decode_members(text: str) -> tuple[int, ...]:
    """``encode_members``' text (and a version-5 trace's plain list) back to the ranks; one tuple per text,
    shared by every trace that names the group (at 4,096 ranks, each trace's own copy of the world's
    4,096 members was 600 MiB of ints on node 0)."""
    out: list[int] = []
    for item in text.split(","):
        first, _, last = item.partition("-")
        out.extend(range(int(first), int(last) + 1) if last else (int(first),))
    return tuple(out)


def site_record(site: str, callsite: str | None, library: str | None, label: str | None) -> bytes:
    return f"S\t{site}\t{clean(callsite)}\t{clean(library)}\t{clean(label)}\n".encode()


def fingerprint_record(fp: int, op: str, reduce_op: str | None, shapes: str, dtypes: str, device: str,
                       root: int | None, is_async: bool, site: str,
                       splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                       members: tuple[int, ...] | None = None) -> bytes:
    """F: everything a traced call's E records share; ``shapes`` and ``dtypes`` already encoded."""
    return (f"F\t{fp}\t{op}\t{reduce_op or NONE}\t{shapes}\t{dtypes}\t{device}\t"
            f"{NONE if root is None else root}\t{int(is_async)}\t{site}\t{encode_splits(splits)}\t"
            f"{_ints(members)}\n").encode()


def native_fingerprint_record(fp: int, op: str, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...],
                              site: str) -> bytes:
    """F for a C++-issued call: what the Flight Recorder knows (no reduce op, device or root)."""
    return (f"F\t{fp}\t{clean(op)}\t{NONE}\t{encode_shapes(shapes)}\t{';'.join(dtypes) or NONE}\t{NONE}\t"
            f"{NONE}\t{NATIVE}\t{site}\t{NONE}\t{NONE}\n").encode()


def error_record(error_id: int, exc: BaseException) -> bytes:
    return f"R\t{error_id}\t{clean(f'{type(exc).__name__}: {exc}'[:MAX_ERROR_CHARS])}\n".encode()


def segment_record(name: str) -> bytes:
    return text_slots(f"B\t{clean(name)}\n".encode())


class RecordBatch:
    """Records to write in one go, in order: definitions (text lines) and E/X slots."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._lines: list[bytes] = []

    def define(self, line: bytes) -> None:
        self._lines.append(line)

    def add(self, record: bytes) -> None:
        self._end_text()
        self._parts.append(record)

    def _end_text(self) -> None:
        if self._lines:
            self._parts.append(text_slots(b"".join(self._lines)))
            self._lines.clear()

    def __bool__(self) -> bool:
        return bool(self._parts or self._lines)

    def data(self) -> bytes:
        self._end_text()
        return b"".join(self._parts)


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
    """A field value that cannot break the line format (and bounds a text record's size)."""
    if text is None or text == "":
        return NONE
    return text[:MAX_FIELD_CHARS].replace("\t", " ").replace("\n", " ").replace("\r", " ").replace("\0", " ")


def _opt(text: str) -> str | None:
    return None if text == NONE else text


# -- reading ---------------------------------------------------------------------------------

_ZERO_SLOT = bytes(SLOT)
_CHECK_WORD = array("Q", [CHECK]).tobytes()


def used_bytes(data: bytes) -> int:
    """How much of a trace file holds records: up to its first all-zero slot.

    Writes are sequential, so the written slots come first and the
    preallocated end is zeros: a binary search finds the boundary.
    """
    lo, hi = 0, len(data) // SLOT
    while lo < hi:
        mid = (lo + hi) // 2
        if data[mid * SLOT:(mid + 1) * SLOT] == _ZERO_SLOT:
            hi = mid
        else:
            lo = mid + 1
    return lo * SLOT


def complete_bytes(data: bytes) -> int:
    """How much of a trace file holds whole records: up to a record torn when its writer was killed."""
    n = used_bytes(data) // SLOT
    return first_bad(slot_words(memoryview(data), n), 0, n) * SLOT


def slot_words(data: bytes | memoryview, slots: int) -> array:
    words = array("Q")
    words.frombytes(data[:slots * SLOT])
    if not _LITTLE:
        words.byteswap()
    return words


def first_bad(words: array, start: int, end: int) -> int:
    """The first slot in [start, end) whose check fails (a record not completely written), or end.

    All slots at once first: each column as one big integer, XORed in C (0.01 µs a slot);
    slot by slot only to find where a file that fails goes wrong.
    """
    if end <= start:
        return end
    columns = [int.from_bytes(words[4 * start + k:4 * end:4].tobytes(), "little") for k in range(4)]
    if columns[0] ^ columns[1] ^ columns[2] ^ int.from_bytes(_CHECK_WORD * (end - start), "little") == columns[3]:
        return end
    for i in range(start, end):
        b = 4 * i
        if words[b] ^ words[b + 1] ^ words[b + 2] ^ CHECK != words[b + 3]:
            return i
    return end


class Tables:
    """The definitions read so far: what E and X records refer to by id."""

    def __init__(self) -> None:
        self.groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.device: set[str] = set()      # groups whose calls complete after they return (D records)
        self.sites: dict[str, tuple[str | None, str | None, str | None]] = {}
        self.fps: dict[int, tuple] = {}
        self.errors: dict[int, str] = {}
        # w0 of an E record -> (group, op, the rest of the Event's fields from reduce_op on)
        self.shared: dict[int, tuple] = {}
        self.version = False
        self.segment: str | None = None    # the name of a B record just read
        # A window's (``files.trace_window``): group -> (first call kept, calls cut, block -> digest), and
        # (node, path) of the whole trace
        self.kept: dict[str, tuple[int, int, dict[int, str]]] = {}
        self.held_at: tuple[int, str] | None = None

    def define(self, text: str) -> int:
        """Take a text record's lines into the tables; return how many lines were not understood."""
        bad = 0
        for line in text.split("\n")[:-1]:
            try:
                if not self._line(line.split("\t")):
                    bad += 1
            except ValueError:
                bad += 1
        return bad

    def _line(self, p: list[str]) -> bool:
        tag, n = p[0], len(p)
        if tag == "F" and n == F_FIELDS:
            self.fps[int(p[1])] = (
                p[2], _opt(p[3]), decode_shapes(p[4]), () if p[5] == NONE else tuple(p[5].split(";")),
                _opt(p[6]), None if p[7] == NONE else int(p[7]), p[8] == "1",
                *self.sites.get(p[9], (None, None, None)), p[8] == NATIVE, decode_splits(p[10]), _decode_ints(p[11]))
        elif tag == "S" and n == 5:
            self.sites[p[1]] = (_opt(p[2]), _opt(p[3]), _opt(p[4]))
        elif tag == "G" and n in (4, 5):   # 4: a trace from before completion records
            self.groups[int(p[1])] = (GroupKey(p[2]), decode_members(p[3]) if p[3] != NONE else ())   # parsed once
            if n == 5 and p[4] == DEVICE:
                self.device.add(p[2])
        elif tag == "R" and n == 3:
            self.errors[int(p[1])] = p[2]
        elif tag == "V" and n == 3:
            self.version = p[1] == "distcheck-trace"
        elif tag == "B" and n == 2:
            self.segment = p[1]
        elif tag == "K" and n == 5:
            digests = {} if p[4] == NONE else {int(b): d for b, d in (x.split(":") for x in p[4].split(","))}
            self.kept[p[1]] = (int(p[2]), int(p[3]), digests)
        elif tag == "H" and n == 3:
            self.held_at = (int(p[1]), p[2])
        else:
            return False
        return True

    def shared_of(self, w0: int) -> tuple | None:
        """(group, op, rest) for an E record's first word; None when it names an undefined id."""
        group = self.groups.get(w0 >> 8 & 0xFFFFFF)
        fp = self.fps.get(w0 >> FP_SHIFT)
        if group is None or fp is None:
            return None
        op, reduce_op, shapes, dtypes, device, root, is_async, callsite, library, label, native, splits, members = fp
        # the last field is the Event's ``t_returned``: None but on a device-completed group (the reader fills it)
        shared = self.shared[w0] = (group[0], op, (reduce_op, shapes, dtypes, device, root, group[1], is_async,
                                                   callsite, library, label, native, splits, members, None))
        return shared


# Positions in ``Tables.shared``'s rest tuple the watchdog needs.
SHARED_ASYNC, SHARED_LABEL, SHARED_NATIVE, SHARED_MEMBERS = 6, 9, 10, 12


class Text:
    """A text record being collected from its T and C slots."""

    __slots__ = ("length", "words")

    def __init__(self, w0: int, w1: int, w2: int) -> None:
        self.length = w0 >> 8
        self.words = [w1, w2]

    def add(self, w0: int, w1: int, w2: int) -> bool:
        """Take a C slot; False when it is not the next one."""
        if w0 >> 8 != len(self.words) // 2:
            return False
        self.words += (w1, w2)
        return True

    @property
    def complete(self) -> bool:
        return len(self.words) * 8 >= self.length

    def text(self) -> str:
        raw = b"".join(w.to_bytes(8, "little") for w in self.words)
        return raw[:self.length].decode("utf-8", "replace")


def text_at(words: array, i: int, end: int) -> tuple[Text, int]:
    """The text record whose T slot is slot ``i``, read from its C slots up to ``end``, and the slot after it
    (the text is not ``complete`` when it runs past ``end`` or a slot is not its next)."""
    text = Text(words[4 * i], words[4 * i + 1], words[4 * i + 2])
    j = i + 1
    while not text.complete and j < end and text.add(words[4 * j], words[4 * j + 1], words[4 * j + 2]):
        j += 1
    return text, j
