"""The Flight Recorder dumps a job left on disk, read beside its stacks: where a rank's environment sets
``TORCH_FR_DUMP_TEMP_FILE`` (the prefix PyTorch writes ``<prefix><rank>`` to on a time-out, or the job's own
``_dump_fr_trace`` to it), its dump gives each group's sequence numbers: the call in flight (not retired) and
how far the rank went in each group. ``judge`` joins them by (group, sequence number).

A dump older than its rank's process is another run's and is left out. Reading is ``files.flight_recorder``'s
(untrusted pickles: no code runs). Nothing is asked of the job: only a file it already wrote is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import psutil

from distcheck.errors import DistcheckError
from distcheck.files.flight_recorder import load_dump, membership, reached, to_events
from distcheck.models import Event

DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"


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
    open: FrCall | None = None

    @property
    def entered(self) -> dict[str, int]:
        return {g: c.seq for g, c in self.last.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "last": {g: _call_dict(c) for g, c in self.last.items()},
                "open": None if self.open is None else _call_dict(self.open)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrState:
        o = d.get("open")
        return cls(str(d["path"]), {str(g): _call(c) for g, c in d["last"].items()}, None if o is None else _call(o))


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
    if path is None:
        return None
    try:
        dump = load_dump(path, rank)
    except (DistcheckError, OSError) as exc:
        return f"{path}: {getattr(exc, 'message', exc)}"
    events = [e for e in to_events(dump, membership([dump], tuple(range(world_size))), reached([dump]))
              if not e.group.startswith("p2p:") and e.seq is not None]
    last: dict[str, Event] = {}
    for e in events:
        if e.group not in last or e.seq > last[e.group].seq:
            last[e.group] = e
    newest = max((e for e in events if e.t_exit is None), key=lambda e: (e.t_enter, e.seq), default=None)
    return FrState(str(path), {g: _of(e) for g, e in last.items()}, None if newest is None else _of(newest))


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
    gloo retires an entry just after waking the caller, so a dump may catch a finished call unretired)."""
    call = states[rank].open if rank in states else None
    if call is None or any(s.entered.get(call.group, 0) > call.seq for s in states.values()):
        return None
    return call
