"""Reading PyTorch Flight Recorder dumps into distcheck ``Event`` values.

A dump is one rank's Flight Recorder ring buffer, written when
``TORCH_FR_BUFFER_SIZE`` is set: the pickle form (``_dump_fr_trace()``, or the
file NCCL's watchdog writes to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` on a timeout)
or the JSON form (``_dump_fr_trace_json()``). Both hold one dict:
``version``, ``pg_config``, ``pg_status``, ``comm_lib_version`` and
``entries``, one entry per collective with ``process_group`` (name, desc),
``collective_seq_id``, ``p2p_seq_id``, ``is_p2p``, ``profiling_name``
(``"gloo:all_reduce"``, ``"nccl:send 0->1"``), ``input_sizes``,
``input_dtypes``, ``state``, ``retired``, ``time_created_ns``,
``time_discovered_*_ns`` and (pickle only) ``frames``.

Measured on torch 2.13 with gloo (format version "2.10"):

* every gloo entry stays ``state == "scheduled"`` (gloo has no start/end
  events); ``retired`` turns True when gloo's worker thread has finished the
  work, successfully or with an error — and only *after* it woke the caller,
  so a dump taken right after a collective can show it not yet retired;
* send/recv (also ``batch_isend_irecv``) are not recorded at all; they use
  ``op_id``\\ s but no ``collective_seq_id``. ``monitored_barrier`` uses two
  ``collective_seq_id``\\ s that never appear in the buffer (the ids stay
  aligned across ranks, with gaps);
* ``pg_config`` is not usable: one entry keyed ``""``, ranks ``[0..N-1]`` on
  rank 0 and ``[]`` elsewhere — gloo dumps do not say who is in which group;
* ``pg_status`` counts ``op_id``\\ s, not ``collective_seq_id``\\ s;
* names seen: all_reduce (also for ``reduce_scatter_tensor``), all_gather
  (also ``all_gather_into_tensor`` and the two calls of
  ``all_gather_object``), all_to_all (``all_to_all_single``), reduce, gather,
  scatter, broadcast (twice for ``broadcast_object_list``), barrier;
* dtypes are c10 names (``Float``, ``Long``, ``BFloat16``, ``Bool``);
* the JSON form has no ``frames`` and writes 0 for unknown times.

What an entry says about how its call ended (``entry_end``), per backend,
from PyTorch's recorder (``FlightRecorderDetail.hpp``) and its backends:

* ``state`` is ``"completed"`` only once ``time_discovered_completed_ns`` is
  set: the call's end event fired (NCCL: the kernel finished), or the
  recorder was told it completed. ``"started"``: its start event fired.
* ``retired`` means the backend is done with the entry, not that the call
  succeeded. NCCL's watchdog retires a work once ``isCompleted()``, which is
  also true for a work that failed, timed out or was aborted; gloo's worker
  thread retires every work after running it, error or not, and sets
  ``pg_status``'s ``last_completed_collective`` the same way (NCCL's
  watchdog too), so neither tells success. On NCCL a retired entry that is
  not ``completed`` ended without finishing (FAILED); so does one of
  ``nccl2`` (torch's newer NCCL backend, whose backend-neutral recorder hook
  retires a call when it is issued and leaves completion to the end event).
  On gloo (and a ``c10d:`` hook entry, which may have no device event)
  retired says only that it ENDED, one way or the other. No dump carries
  the error itself.

No dump records the reduce op, the root (src/dst), the device or async_op;
the rank is known only from the file name (the number it ends with).

Pickles are untrusted input: they are read by an unpickler that resolves no
global at all, so nothing but dicts, lists, tuples, strings, numbers, bools
and None can come out of one, and no code runs.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from distcheck.errors import CorruptInputError, UsageError
from distcheck.files.salvage import RefusedPickle, load_json as _load_json, load_pickle as _load_pickle
from distcheck.models import Event, GroupKey

# c10 ScalarType names → torch dtype names (as the tracer writes them).
DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "ComplexHalf": "complex32", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
    "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64",
}
# backend op names → torch.distributed API names where they differ.
OPS = {
    "allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced":
    "reduce_scatter_tensor_coalesced", "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "allreduce_coalesced": "all_reduce_coalesced",
}
REQUIRED = ("profiling_name",)   # the group comes from process_group, or pg_id in older formats
_P2P_NAME = re.compile(r"^(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin|txt))?$", re.IGNORECASE)
CANNOT_TELL = ("reduce op", "root (src/dst)", "device", "async_op", "module label")


# -- loading --------------------------------------------------------------------


def sniff(data: bytes) -> str | None:
    """'pickle', 'json' or None."""
    if data[:1] == b"\x80":
        return "pickle"
    if data.lstrip()[:1] == b"{":
        return "json"
    return None


def rank_from_name(path: Path) -> int | None:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


@dataclass
class Dump:
    """One rank's Flight Recorder dump, as read."""

    path: Path
    rank: int
    form: str                                   # pickle | json
    version: str = ""
    entries: list[dict[str, Any]] = field(default_factory=list)
    pg_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)   # pg name → global ranks
    comm_lib_version: str = ""
    truncated: bool = False
    skipped_entries: int = 0                    # entries without the fields we need

    @property
    def backends(self) -> set[str]:
        return {str(e["profiling_name"]).split(":", 1)[0] for e in self.entries if ":" in str(e["profiling_name"])}

    @property
    def wrapped(self) -> bool:
        """The ring buffer overflowed: older entries are gone."""
        first = self.entries[0].get("record_id") if self.entries else 0
        return isinstance(first, int) and first > 0


def load_dump(path: Path, rank: int | None = None) -> Dump:
    """Read one dump. UsageError for a refused pickle or a nameless file,
    CorruptInputError for a file with nothing readable in it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    if rank is None:
        rank = rank_from_name(path)
        if rank is None:
            raise UsageError(f"{path}: cannot tell which rank wrote this dump",
                             "name dumps PREFIX<rank> (as PyTorch does: TORCH_FR_DUMP_TEMP_FILE + rank)")
    if not data:                                # a rank that died before writing a byte
        return Dump(path=path, rank=rank, form="empty", truncated=True)
    # Anything that is not JSON goes through the restricted unpickler (protocol 0
    # and 1 pickles have no header): it cannot run code, only fail.
    form = "json" if sniff(data) == "json" else "pickle"
    try:
        if form == "pickle":
            obj, truncated = _load_pickle(data)
        else:
            obj, truncated = _load_json(data.decode("utf-8", errors="replace"))
    except RefusedPickle as exc:
        raise UsageError(
            f"{path}: refused to load this pickle: it asks to import {exc}; a Flight Recorder dump holds "
            f"only dicts, lists, strings and numbers", "do not load pickles of unknown origin") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise CorruptInputError(f"{path}: not a readable Flight Recorder dump ({exc})",
                                "pass the files PyTorch wrote (pickle or JSON), or distcheck traces") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        raise CorruptInputError(f"{path}: not a Flight Recorder dump (no 'entries' list)",
                                "pass the files PyTorch wrote (pickle or JSON), or distcheck traces")
    dump = Dump(path=path, rank=rank, form=form or "", version=str(obj.get("version", "")),
                comm_lib_version=str(obj.get("comm_lib_version") or ""), truncated=truncated)
    for e in obj.get("entries", []):
        if isinstance(e, dict) and all(k in e for k in REQUIRED) and _seq_of(e) is not None:
            dump.entries.append(e)
        else:
            dump.skipped_entries += 1
    dump.pg_ranks = _pg_ranks(obj.get("pg_config"))
    return dump


def _pg_ranks(config: Any) -> dict[str, tuple[int, ...]]:
    """pg name → global ranks, from pg_config where it says (NCCL); gloo's is empty."""
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(config, dict):
        return out
    for key, pg in config.items():
        if not isinstance(pg, dict):
            continue
        name = str(pg.get("name") or key or "")
        ranks = pg.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)       # "[0, 1, 2]" — never eval()
            except ValueError:
                continue
        if name and isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            out[name] = tuple(ranks)
    return out


# -- conversion -----------------------------------------------------------------


def _seq_of(e: dict[str, Any]) -> int | None:
    seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id", e.get("seq_id"))
    return seq if isinstance(seq, int) else None


def pg_of(e: dict[str, Any]) -> tuple[str, str]:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(e.get("pg_id", pg)), ""


def group_label(name: str, desc: str) -> GroupKey:
    return GroupKey(f"{name}:{desc}" if desc and desc != "undefined" else name)


def op_name(profiling_name: str) -> tuple[str, str | None]:
    """("all_reduce", "gloo") from "gloo:all_reduce"."""
    named, sep, op = str(profiling_name).partition(":")
    backend: str | None = named
    if not sep:
        backend, op = None, named
    op = op.strip()
    return OPS.get(op, op), backend


def _dtype(name: Any) -> str:
    return DTYPES.get(str(name), str(name).lower())


def _shapes(sizes: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(sizes, list):
        return ()
    out = []
    for s in sizes:
        if isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s):
            out.append(tuple(s))
    return tuple(out)


_SITE_PKG = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+\.\d+[/\\]")
_DISTCHECK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # distcheck/, not files/


class _Frame(Enum):
    USER = "user"
    LIBRARY = "library"
    TORCH = "torch"
    SKIP = "skip"


def _frame_kind(filename: str) -> _Frame:
    """user | library | torch | skip — from the path alone (dumps come from other machines)."""
    if not filename or filename.startswith("<"):
        return _Frame.SKIP
    m = _SITE_PKG.search(filename)
    if m:
        return _Frame.TORCH if m.group(1) == "torch" else _Frame.LIBRARY
    if re.search(r"[/\\]torch[/\\](distributed|nn|utils|_dynamo|autograd|cuda)[/\\]", filename):
        return _Frame.TORCH
    if filename.startswith(_DISTCHECK_DIR) and "builtin_scenarios" not in filename:
        return _Frame.SKIP
    if _STDLIB.search(filename):
        return _Frame.SKIP
    return _Frame.USER


def callsites(frames: Any) -> tuple[str | None, str | None]:
    """(innermost user frame, innermost library frame) as 'file:line:function'."""
    user = library = None
    if not isinstance(frames, list):
        return None, None
    for f in frames:                               # innermost first
        if not isinstance(f, dict):
            continue
        kind = _frame_kind(str(f.get("filename", "")))
        text = f"{f.get('filename')}:{f.get('line')}:{f.get('name')}"
        if kind is _Frame.LIBRARY and library is None and user is None:
            library = text
        elif kind is _Frame.USER:
            user = text
            break
    return user, library


def _ns(value: Any) -> float | None:
    return value / 1e9 if isinstance(value, (int, float)) and value > 0 else None


@dataclass(frozen=True)
class Membership:
    """Who is in which process group, as far as the dumps tell."""

    world: tuple[int, ...]
    groups: dict[str, tuple[int, ...]]          # pg name → global ranks
    inferred: tuple[str, ...] = ()              # pg labels whose members were inferred


def membership(dumps: list[Dump], world: tuple[int, ...]) -> Membership:
    """pg_config where it names the ranks (NCCL); otherwise the world for the
    default group and, for other groups, the ranks whose dumps mention them.

    Only ranks in ``world`` are members: a rank without a (complete) dump is
    left out, or the analysis would take it for a rank that never came.
    """
    keep = set(world)
    groups: dict[str, tuple[int, ...]] = {}
    for d in dumps:
        for name, ranks in d.pg_ranks.items():
            groups.setdefault(name, tuple(r for r in ranks if r in keep))
    seen: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for d in dumps:
        if d.rank not in keep:
            continue
        for e in d.entries:
            if e.get("is_p2p"):
                continue
            name, desc = pg_of(e)
            seen.setdefault(name, set()).add(d.rank)
            descs.setdefault(name, desc)
    inferred = []
    for name, seen_by in seen.items():
        if name in groups:
            continue
        if descs.get(name) == "default_pg" or name == "0":
            groups[name] = world
        else:
            groups[name] = tuple(sorted(seen_by))
            inferred.append(group_label(name, descs.get(name, "")))
    return Membership(world=world, groups=groups, inferred=tuple(sorted(inferred)))


class EntryEnd(str, Enum):
    """How an entry's call had ended when its dump was taken, as far as the entry says."""

    COMPLETED = "completed"   # its end event fired: the call finished
    FAILED = "failed"         # retired, its end event never fired (NCCL): an error, a time-out, an abort
    ENDED = "ended"           # retired where the backend does not say how (gloo, the c10d: hook)
    PENDING = "pending"       # not retired: in flight when the dump was taken


_END_EVENT_BACKENDS = frozenset({"nccl", "nccl2"})   # their entries carry the call's end event


def entry_end(e: dict[str, Any]) -> EntryEnd:
    """What one entry says of its call's end (see the module's notes on ``state`` and ``retired``)."""
    if e.get("state") == "completed":
        return EntryEnd.COMPLETED
    if e.get("retired") is not True:
        return EntryEnd.PENDING
    backend = op_name(e.get("profiling_name", ""))[1]
    return EntryEnd.FAILED if backend in _END_EVENT_BACKENDS else EntryEnd.ENDED


Reached = dict[str, dict[int, int]]   # pg name → rank → the highest collective_seq_id its dump holds


def reached(dumps: list[Dump]) -> Reached:
    """How far each rank's dump went in each group (collectives only; ranks with no entry tell nothing)."""
    out: Reached = {}
    for d in dumps:
        for e in d.entries:
            seq = _seq_of(e)
            if e.get("is_p2p") or seq is None:
                continue
            ranks = out.setdefault(pg_of(e)[0], {})
            ranks[d.rank] = max(ranks.get(d.rank, 0), seq)
    return out


def never_entered(dump: Dump, e: dict[str, Any], members: Membership, seen: Reached) -> tuple[int, ...]:
    """Members of the entry's group whose dumps hold entries but never reached its call.

    A collective cannot finish before every member entered it, so an ENDED
    entry with such members ended in an error (gloo's time-out, a peer's
    exit). A member without a usable dump is unknown, never counted here.
    """
    seq = _seq_of(e)
    if e.get("is_p2p") or seq is None:
        return ()
    name = pg_of(e)[0]
    told = seen.get(name, {})
    has_entries = {r for ranks in seen.values() for r in ranks}
    return tuple(m for m in members.groups.get(name, ()) if m != dump.rank and m in has_entries
                 and told.get(m, 0) < seq)


def _finished(dump: Dump, entries: list[dict[str, Any]], members: Membership, seen: Reached | None) -> list[bool]:
    """Per entry: did its call finish? COMPLETED did; ENDED did where every member with a dump entered it
    (without ``seen``, as before: retired counts); FAILED did not. A PENDING entry did where a later entry
    of its group on this rank finished (calls of one group finish in order; gloo retires on its worker
    thread just after waking the caller, so the newest finished entry may not show it yet)."""
    ends = [entry_end(e) for e in entries]
    done = [end == EntryEnd.COMPLETED or (end == EntryEnd.ENDED and not (
        seen is not None and never_entered(dump, e, members, seen))) for e, end in zip(entries, ends)]
    later_done: set[str] = set()
    for i in range(len(entries) - 1, -1, -1):
        key = "p2p" if entries[i].get("is_p2p") else pg_of(entries[i])[0]
        if done[i]:
            later_done.add(key)
        elif key in later_done and ends[i] == EntryEnd.PENDING:
            done[i] = True
    return done


def to_events(dump: Dump, members: Membership, seen: Reached | None = None) -> list[Event]:
    """One rank's entries as Events, in the order the rank issued them; a call that
    did not finish (``_finished``) has no exit time. ``seen``: ``reached`` over
    every usable dump, which tells a retired gloo call that ended in an error."""
    entries = sorted(dump.entries, key=lambda e: e.get("record_id", 0) if isinstance(e.get("record_id"), int) else 0)
    done = _finished(dump, entries, members, seen)
    p2p_counts: dict[str, int] = {}
    events = []
    for e, completed in zip(entries, done):
        name, desc = pg_of(e)
        op, _backend = op_name(e["profiling_name"])
        group_ranks = members.groups.get(name, ())
        group, seq = group_label(name, desc), _seq_of(e)
        if e.get("is_p2p"):
            m = _P2P_NAME.match(op)
            if m is None:
                continue
            kind, a, arrow, b = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            src, dst = (a, b) if arrow == "->" else (b, a)
            if group_ranks:                           # group-local → global ranks
                src = group_ranks[src] if src < len(group_ranks) else src
                dst = group_ranks[dst] if dst < len(group_ranks) else dst
            group = GroupKey.p2p(src, dst)
            seq = p2p_counts[group] = p2p_counts.get(group, 0) + 1
            op, group_ranks = kind, (src, dst)
        t_enter = _ns(e.get("time_created_ns")) or 0.0
        t_exit = (_ns(e.get("time_discovered_completed_ns")) or t_enter) if completed else None
        callsite, library_callsite = callsites(e.get("frames"))
        events.append(Event(
            # seq: None where the dump numbers no call (an entry without ids), as it always was
            rank=dump.rank, group=group, seq=seq, op=op, reduce_op=None,  # type: ignore[arg-type]
            shapes=_shapes(e.get("input_sizes")),
            dtypes=tuple(_dtype(d) for d in e.get("input_dtypes") or ()),
            device=None, root=None, group_ranks=group_ranks, async_op=False,
            t_enter=t_enter, t_exit=t_exit, callsite=callsite, library_callsite=library_callsite,
        ))
    return events
