"""The Flight Recorder dumps a job left on disk, read beside its stacks: where a rank's environment sets
``TORCH_FR_DUMP_TEMP_FILE`` (the prefix PyTorch writes ``<prefix><rank>`` to on a time-out, or the job's own
``_dump_fr_trace`` to it), its dump gives each group's sequence numbers: the call in flight (not retired) and
how far the rank went in each group. ``judge`` joins them by (group, sequence number).

On NCCL (``nccl``, ``nccl2``) a call returns once enqueued and completes on the device later, in issue order on its
group's stream: the call the rank waits in is the *first* not completed (its entry's ``state``, and ``pg_status``'s
``last_completed_collective`` for its group), not the newest, and another rank's dump that went past it (enqueued
later calls) says nothing of its completion. On gloo an entry is retired just after its caller woke: the newest
not retired is the call in flight.

A dump older than its rank's process is another run's and is left out. Reading is ``files.flight_recorder``'s
(untrusted pickles: no code runs). Nothing is asked of the job: only a file it already wrote is read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from distcheck.errors import DistcheckError
from distcheck.files.flight_recorder import Dump, group_label, load_dump, membership, pg_of, reached, sniff, to_events
from distcheck.files.salvage import RefusedPickle, load_json, load_pickle
from distcheck.models import Event
from distcheck.models.group_key import is_p2p

DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
DEVICE_BACKENDS = frozenset({"nccl", "nccl2"})   # their entries complete on the device, after the call returned
STATUS_KEYS = ("last_enqueued_collective", "last_started_collective", "last_completed_collective")


@dataclass(frozen=True)
class FrCall:
    """One collective of a rank's dump: its group's label, its sequence number, what it was."""

    group: str
    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    callsite: str | None = None


@dataclass(frozen=True)
class FrState:
    """What one rank's dump says: the path, how far it went in each group, the call it had in flight."""

    path: str
    last: Mapping[str, FrCall]         # group -> the newest call of it the dump holds (how far the rank went)
    open: FrCall | None = None         # on NCCL: the first call not completed on the device
    device: bool = False               # NCCL's dump: its calls complete on the device, after they returned
    status: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)   # group -> NCCL's pg_status

    @property
    def entered(self) -> dict[str, int]:
        return {g: c.seq for g, c in self.last.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "last": {g: _call_dict(c) for g, c in self.last.items()},
                "open": None if self.open is None else _call_dict(self.open), "device": self.device,
                "status": {g: dict(s) for g, s in self.status.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrState:
        o = d.get("open")
        return cls(str(d["path"]), {str(g): _call(c) for g, c in d["last"].items()}, None if o is None else _call(o),
                   bool(d.get("device", False)), {str(g): dict(s) for g, s in (d.get("status") or {}).items()})


def _call_dict(c: FrCall) -> dict[str, Any]:
    return {"group": c.group, "seq": c.seq, "op": c.op, "shapes": [list(s) for s in c.shapes],
            "dtypes": list(c.dtypes), "callsite": c.callsite}


def _call(d: Mapping[str, Any]) -> FrCall:
    return FrCall(str(d["group"]), int(d["seq"]), str(d["op"]), tuple(tuple(s) for s in d["shapes"]),
                  tuple(d["dtypes"]), d.get("callsite"))


def _of(e: Event) -> FrCall:
    return FrCall(e.group, int(e.seq), e.op, e.shapes, e.dtypes, e.callsite)


def dump_path(pid: int, rank: int, env: Mapping[str, str]) -> Path | None:
    """The rank's dump if its environment names one, it exists, and it was written by this process's run."""
    prefix = env.get(DUMP_PREFIX)
    if not prefix:
        return None
    path = Path(prefix + str(rank))
    try:
        fresh = path.stat().st_mtime >= psutil.Process(pid).create_time() - 1.0
    except (OSError, psutil.Error):
        return None
    return path if fresh else None


def read_state(pid: int, rank: int, world_size: int, env: Mapping[str, str]) -> FrState | str | None:
    """The rank's Flight Recorder state; None without a dump; why, in words, when its dump cannot be read."""
    path = dump_path(pid, rank, env)
    return None if path is None else read_file(path, rank, world_size)


def read_file(path: Path, rank: int, world_size: int) -> FrState | str:
    """One rank's dump file read; why, in words, when it cannot be."""
    try:
        dump = load_dump(path, rank)
    except (DistcheckError, OSError) as exc:
        return f"{path}: {getattr(exc, 'message', exc)}"
    return state_of(dump, world_size, _raw_status(path))


def state_of(dump: Dump, world_size: int, raw_status: Any = None) -> FrState:
    """What one rank's dump says (``raw_status``: its ``pg_status``, as the file holds it). Pure."""
    events = [e for e in to_events(dump, membership([dump], tuple(range(world_size))), reached([dump]))
              if not is_p2p(e.group) and e.seq is not None]
    last: dict[str, Event] = {}
    for e in events:
        if e.group not in last or e.seq > last[e.group].seq:
            last[e.group] = e
    device = bool(dump.backends & DEVICE_BACKENDS)
    status = pg_status(dump, raw_status) if device else {}
    pending = [e for e in events if e.t_exit is None
               and e.seq > status.get(e.group, {}).get("last_completed_collective", -1)]
    if device:   # in issue order: the first not completed holds up every later one on its stream
        first = pending[0] if pending else None
    else:
        first = max(pending, key=lambda e: (e.t_enter, e.seq), default=None)
    return FrState(str(dump.path), {g: _of(e) for g, e in last.items()}, None if first is None else _of(first),
                   device, status)


def pg_status(dump: Dump, raw: Any) -> dict[str, dict[str, int]]:
    """NCCL's ``pg_status`` (keyed by the group's id, as each entry's ``pg_id``) by the group's label, as the events
    name it: how far each group was enqueued, started and completed on the device (-1: not known)."""
    if not isinstance(raw, Mapping):
        return {}
    labels = {str(e.get("pg_id")): group_label(*pg_of(e)) for e in dump.entries if "pg_id" in e}
    out: dict[str, dict[str, int]] = {}
    for key, s in raw.items():
        if isinstance(s, Mapping) and str(key) in labels:
            out[labels[str(key)]] = {k: int(s[k]) for k in STATUS_KEYS if isinstance(s.get(k), int)}
    return out


def _raw_status(path: Path) -> Any:
    """The dump's ``pg_status`` (``files.flight_recorder`` keeps only its entries), through the same loaders that
    run no code; None where it cannot be read."""
    try:
        data = path.read_bytes()
        obj = load_json(data.decode("utf-8", "replace"))[0] if sniff(data) == "json" else load_pickle(data)[0]
    except (OSError, ValueError, RecursionError, MemoryError, RefusedPickle):
        return None
    return obj.get("pg_status") if isinstance(obj, dict) else None


def is_default_group(group: str) -> bool:
    name, _, desc = group.partition(":")
    return name == "0" or desc == "default_pg"


def members(group: str, states: Mapping[int, FrState], world_size: int) -> tuple[int, ...]:
    """The group's ranks: the world for the default group, else the ranks whose dumps hold it (gloo's dumps do
    not name a group's members)."""
    if is_default_group(group):
        return tuple(range(world_size))
    return tuple(sorted(r for r, s in states.items() if group in s.entered))


def open_call(rank: int, states: Mapping[int, FrState]) -> FrCall | None:
    """The rank's call in flight, unless another rank's dump went past it in that group (then it completed:
    gloo retires an entry just after waking the caller, so a dump may catch a finished call unretired). On NCCL the
    dump's own state says it (its CUDA events, read when the dump was written)."""
    state = states.get(rank)
    call = state.open if state is not None else None
    if call is None or state is None or state.device:   # NCCL: another rank's later calls were enqueued, not completed
        return call
    if any(s.entered.get(call.group, 0) > call.seq for s in states.values()):
        return None
    return call
