"""When a collective's work is done, on a backend whose calls return before it (rule 1 on NCCL).

On gloo a call returns when its work is done. On NCCL it returns once its work is enqueued on a CUDA stream, and
the rank blocks later, somewhere else (``loss.item()``, ``torch.cuda.synchronize()``); ``Work.wait()`` only orders
streams. There a call's return proves nothing: distcheck keeps the call open, and the rank waiting in it, until
the backend says its work completed. This module is where that is read, one *completion source* per group:

* **NCCL** (``nccl``, and its successor ``nccl2``): PyTorch's Flight Recorder. It records every collective of a
  group whoever issued it (Python, DDP's reducer, FSDP2), and NCCL's watchdog thread marks each entry completed
  when the stream has run it (every 100 ms); a dump also queries the entries' CUDA events itself. Read without
  stack traces, only while a group has calls not known to be done, at most every ``DUMP_EVERY_S`` (and no more
  often than 20 times what a read costs: a ring of 20,000 entries is read less often; distcheck's default ring is
  256 entries; ``benchmarks/completion_source.py`` measures it). A per-op entry of a coalesced group never completes by
  itself; its group entry, with the same number, does.
* **A backend registered from Python** whose process group offers ``_register_on_completion_hook`` (NCCL's
  process group's completion hook; ``distcheck.testing.emulated_nccl``'s): the hook, called with each completed
  call's ``seq`` on the backend's own thread. Attached when the group is first seen, before its first call.
* Any other backend (gloo, MPI, a C++ extension's): a call is done when it returns (``device`` is False).

What every source yields is the same: for each group, the group counter's number every call up to which has
completed (calls on one group complete in issue order: they run on one stream). The sidecar (``rank.native``)
turns that into the trace's D records. P2P calls (NCCL numbers them apart) are not read here: their waits are.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from distcheck.rank.guard import Hook, failed

DUMP_EVERY_S = 0.05
# A read of the Flight Recorder costs in proportion to its ring (benchmarks/completion_source.py): read no more often
# than this many times its own cost, so the sidecar never takes more than ~5% of a core (a ring of 256, distcheck's
# default, stays at DUMP_EVERY_S).
DUMP_COST_FACTOR = 20
FLIGHT_RECORDER_BACKENDS = ("nccl", "nccl2")   # backends whose completion is read from the Flight Recorder
_P2P_OPS = ("send", "recv", "isend", "irecv", "recv_anysource")


def backend_of(pg: Any) -> str | None:
    """The group's backend as ``torch.distributed`` names it (None where it cannot say)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return str(dist.get_backend(pg)).lower() if dist is not None else None
    except Exception:   # a group torch no longer knows (destroyed), or a stand-in
        return None


def python_completion_hook(pg: Any) -> Callable[..., Any] | None:
    """The process group's own ``_register_on_completion_hook`` where a backend written in Python defines it (torch's
    C++ method refuses every backend but NCCL's; it is not this)."""
    dist = sys.modules.get("torch.distributed")
    own = getattr(type(pg), "_register_on_completion_hook", None)
    base = getattr(getattr(dist, "ProcessGroup", None), "_register_on_completion_hook", None)
    return pg._register_on_completion_hook if own is not None and own is not base else None


def done_through(entries: Iterable[dict], previous: dict[str, int]) -> dict[str, int]:
    """From Flight Recorder entries: each group's number every collective up to which completed (``previous``: what
    was known before). Only numbers the ring still holds advance it; a number older than the ring is long done."""
    seen: dict[str, dict[int, bool]] = defaultdict(dict)
    for e in entries:
        if e.get("is_p2p"):
            continue
        group = e.get("process_group") or ("",)
        seq = int(e.get("collective_seq_id", -1))
        done = e.get("state") == "completed" or bool(e.get("time_discovered_completed_ns"))
        seqs = seen[str(group[0])]
        seqs[seq] = seqs.get(seq, False) or done   # a coalesced group's entry completes for its per-op entries
    out = {}
    for group, seqs in seen.items():
        upto = max(previous.get(group, 0), min(seqs) - 1)
        while seqs.get(upto + 1):
            upto += 1
        out[group] = upto
    return out


class Completion:
    """The rank's completion sources, by group (the trace's group key); thread-safe for the hooks' threads."""

    def __init__(self, fr_dump: Callable[[str], Any] | None = None, clock: Callable[[], float] | None = None) -> None:
        import time

        self._fr_dump = fr_dump or _flight_recorder_dump
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._sources: dict[str, str] = {}             # group -> "flight-recorder:<backend>" | "hook"
        self._done: dict[str, int] = {}                # group -> counter number done through
        self._names: dict[str, str] = {}               # Flight Recorder group name -> the trace's group key
        self._last_dump = float("-inf")
        self._dump_every_s = DUMP_EVERY_S

    def attach(self, pg: Any, key: str, name: str | None = None) -> bool:
        """Watch ``pg`` (the trace's group ``key``; ``name``: its name in the Flight Recorder, default ``key``) and
        say whether its calls complete after they return. Idempotent; its own failure is counted (rule 0) and the
        group is then taken as done at return."""
        with self._lock:
            if key in self._sources:
                return True
        try:
            source = self._source_for(pg, key)
        except Exception as exc:
            failed(Hook.COMPLETION, exc)
            return False
        if source is None:
            return False
        with self._lock:
            self._sources[key] = source
            self._names[name or key] = key
        return True

    def device(self, key: str) -> bool:
        return key in self._sources

    def _source_for(self, pg: Any, key: str) -> str | None:
        backend = backend_of(pg)
        if backend in FLIGHT_RECORDER_BACKENDS:
            return f"flight-recorder:{backend}"
        register = python_completion_hook(pg)
        if register is None:
            return None
        register(lambda info: self._on_complete(key, info))
        return "hook"

    def _on_complete(self, key: str, info: Any) -> None:
        """A backend's completion hook, on its own thread: never raises into it (rule 0)."""
        try:
            if str(getattr(info, "op_type", "")).lower() in _P2P_OPS:
                return
            seq = int(info.seq)
            with self._lock:
                if seq > self._done.get(key, 0):
                    self._done[key] = seq
        except Exception as exc:
            failed(Hook.COMPLETION, exc)

    def done_through(self, pending: Callable[[str], bool] = lambda key: True) -> dict[str, int]:
        """Each watched group's counter number every call up to which completed. The Flight Recorder is read only
        where ``pending(key)`` (a group with calls not known done), at most every ``DUMP_EVERY_S``."""
        readers = {source for key, source in self._sources.items() if source != "hook" and pending(key)}
        now = self._clock()
        if readers and now - self._last_dump >= self._dump_every_s:
            for source in readers:
                self._read_flight_recorder(source.partition(":")[2])
            self._last_dump = self._clock()
            self._dump_every_s = max(DUMP_EVERY_S, DUMP_COST_FACTOR * (self._last_dump - now))
        with self._lock:
            return dict(self._done)

    def _read_flight_recorder(self, backend: str) -> None:
        dump = self._fr_dump(backend)
        if dump is None:
            return
        by_name = done_through(dump.get("entries", ()),
                               {name: self._done.get(key, 0) for name, key in self._names.items()})
        with self._lock:
            for name, upto in by_name.items():
                key = self._names.get(name)
                if key is not None and upto > self._done.get(key, 0):
                    self._done[key] = upto

    def forget(self, key: str) -> None:
        """The group was destroyed (or a segment restarts its numbers): nothing more is read for it."""
        with self._lock:
            self._sources.pop(key, None)
            self._done.pop(key, None)
            for name in [n for n, k in self._names.items() if k == key]:
                del self._names[name]


def _flight_recorder_dump(backend: str) -> dict | None:
    """The Flight Recorder's entries for ``backend``, without stack traces (None where it cannot be read)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return None
    try:
        if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
            raw = c10d._dump_nccl_trace(True, False, False)
        else:   # torch's backend-neutral recorder (nccl2 records there, per backend)
            raw = c10d._dump_fr_trace(True, False, False, backend=backend)
        return pickle.loads(raw)
    except Exception as exc:
        failed(Hook.COMPLETION, exc)
        return None
