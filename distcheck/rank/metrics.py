"""Recording torchmetrics inside a rank, for a single-process reference after the launch.

When (and only when) the user's code imports torchmetrics, a post-import hook wraps ``Metric.update``/``forward``/
``compute``/``reset`` (through ``Metric._wrap_update``/``_wrap_compute``, which every instance goes through) and the
same methods of ``MetricCollection``, through the rank's ``Patches``. Updates are credited to the object whose state
they change: every metric records its own (a composite's children, a wrapper's inner metric), except the members of a
``MetricCollection``, whose updates are the collection's (compute groups share states between members). A
``compute()`` inside another recorded one (a collection's members) is the outer one's. Each recorded object keeps:

* a copy taken before its first update, pickled *by value* when its class lives in the user's own code (a script
  without a main guard, a class inside a function, a module loaded from a path): the replay never runs it again;
* every ``update()``'s arguments as detached CPU copies, tagged with how many resets came before;
* every ``compute()``: its value, the user's line, the object's local (pre-sync) state, and the sync point (process
  group, its sequence number before and after, this rank's rank in it, the time) by which ``files.metric_records``
  pairs it with the other ranks' computes.

The metric itself is never touched: inputs are copied, the original call runs unchanged. Bounded memory in the rank
(rule 0): a recorded object is held by a weak reference; inputs and states are capped per rank
(``DISTCHECK_METRIC_MEMORY_MB``, default 256: past it only the cross-rank comparison of results remains); inputs go to
disk every ``FLUSH_BYTES``, compute records every ``SPILL_COMPUTES``; at most ``MAX_ENTRIES`` objects,
``MAX_COMPUTES`` compute records and ``MAX_VALUE_ELEMENTS_KEPT`` result elements; row digests
(``rank.row_digests``) have a cap of their own. Reaching a cap is one ``coverage`` note.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distcheck.files.metric_records import append_computes, pack, spill_name
from distcheck.rank.guard import Hook, capped, failed
from distcheck.rank.patches import Patches
from distcheck.rank.metric_copies import compute_record, dumps_by_value, elements as _elements, jsonable, pickler
from distcheck.rank.metric_sync import (MetricCall as Call, _is_collection, _judged, _seq, _sync_on_compute,
                                        _sync_point, metrics_of, user_callsite)
from distcheck.rank.row_digests import RowDigests, digest_rows, digested_epoch, packed_tensors, rows_cap

MEMORY_ENV = "DISTCHECK_METRIC_MEMORY_MB"
DEFAULT_MEMORY_MB = 256
FLUSH_BYTES = 4 * 2**20        # recorded inputs held in memory before they are written out
MAX_ENTRIES = 4_096            # recorded objects per rank (a metric made per evaluation pass)
MAX_COMPUTES = 20_000          # compute() records per rank
SPILL_COMPUTES = 64            # compute() records of one object held in memory before they are written out
MAX_VALUE_ELEMENTS_KEPT = 2**21   # elements of compute() results kept per rank
MAX_STREAMS = 20_000           # (metric, epoch) streams of row digests per rank
_LIBRARY_METRICS = ("lightning", "pytorch_lightning")   # Lightning's own self.log accumulators

class _Entry:
    """One recorded Metric or MetricCollection on this rank."""

    def __init__(self, key: str, obj: Any, collection: bool) -> None:
        cls = type(obj)
        self.key, self.collection = key, collection
        try:   # weak: a metric the user drops is freed, its record stays
            self.ref: Callable[[], Any] = weakref.ref(obj)
        except TypeError:
            self.ref = lambda: obj
        self.info: dict[str, Any] = {
            "id": key, "class": cls.__name__, "module": cls.__module__, "qualname": cls.__qualname__,
            "collection": collection, "sync_on_compute": _sync_on_compute(obj), "fresh": None, "chunks": [],
            "updates": 0, "computes": [], "note": None}
        self.epoch = 0            # resets so far
        self.in_epoch = 0         # updates since the last reset
        self.pending: list[tuple] = []   # ("u", epoch, args, kwargs) and ("s", compute index, local state)
        self.pending_bytes = 0
        self.rows: dict[int, dict[str, Any]] = {}   # epoch -> its row digests (rank.row_digests)
        self.computes: list[tuple] = []   # (epoch, updates, callsite, value, sync tuple or None): _compute_record
        self.spilled = 0                  # compute records already written to its spill file
        self.chunks = array("q")          # numbers of the files its inputs went to

    @property
    def obj(self) -> Any:
        """The recorded object, or None once the user's code let it go."""
        return self.ref()


class MetricRecorder:
    def __init__(self, directory: Path, cap_bytes: int) -> None:
        self.dir, self.cap = directory, cap_bytes
        self.entries: dict[int, _Entry] = {}
        self.retired: list[_Entry] = []   # objects freed whose id a newer object took: still to be drained
        self.bytes = 0
        self.over_cap: str | None = None
        self.rows = RowDigests(rows_cap())
        self.computes = 0          # compute records kept (MAX_COMPUTES)
        self.value_elements = 0    # elements of their values (MAX_VALUE_ELEMENTS_KEPT)
        self._shared: dict[Any, Any] = {}   # one copy of each callsite and group's ranks, however many computes
        self._local = threading.local()
        self._chunks = 0
        self._drains = 0     # file names stay unique across the scenarios of a batched launch

    # -- the wrapped calls -------------------------------------------------------------

    def _stack(self) -> list[tuple[Any, str]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _credited_elsewhere(self, obj: Any, kind: Call) -> bool:
        """Whether a recorded call already running accounts for this one: the same object's
        (forward's own update/compute/reset), a collection's update of its members, or any
        compute() around this compute()."""
        stack = self._stack()
        if any(o is obj for o, _ in stack):
            return True
        if kind is Call.COMPUTE:
            return any(k is Call.COMPUTE for _, k in stack)
        return any(_is_collection(o) for o, _ in stack)

    def call(self, obj: Any, kind: Call, call: Callable[[], Any], args: tuple = (), kwargs: dict | None = None,
             collection: bool = False) -> Any:
        """Run the user's call, once and as it is; record it unless another recorded call accounts for it.
        Rule 0: an error in the recording is counted (rank.guard), never raised into the user's call."""
        try:
            skip = (type(obj).__module__.split(".")[0] in _LIBRARY_METRICS or not _judged(obj)
                    or self._credited_elsewhere(obj, kind) or self._full(obj))
            stack = self._stack()
        except Exception as exc:
            self._unrecorded(obj, exc)
            return call()
        if skip:
            return call()
        stack.append((obj, kind))
        try:
            try:
                entry = self._entry(obj, collection)
                copied = self._copy_inputs(args, kwargs or {}) if kind is Call.UPDATE else None
            except Exception as exc:
                self._unrecorded(obj, exc)
                return call()
            if kind is Call.COMPUTE:
                return self._compute(entry, call)
            result = call()
            try:
                self._after(entry, kind, copied, args, kwargs)
            except Exception as exc:
                self._unrecorded(obj, exc)
            return result
        finally:
            stack.pop()

    def _full(self, obj: Any) -> bool:
        """Whether ``obj`` is a new object past the cap on recorded objects (then it is not recorded)."""
        entry = self.entries.get(id(obj))
        if len(self.entries) + len(self.retired) < MAX_ENTRIES or (entry is not None and entry.obj is obj):
            return False
        capped(Hook.METRICS_CAP, f"more than {MAX_ENTRIES:,} torchmetrics objects; later ones were not recorded")
        return True

    def _after(self, entry: _Entry, kind: Call, copied: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        if kind is Call.UPDATE:
            entry.info["updates"] += 1
            entry.in_epoch += 1
            self._digest(entry, copied if copied is not None else (args, kwargs or {}))
            if copied is not None and self.over_cap is None:
                entry.pending.append(("u", entry.epoch, *copied))
                entry.pending_bytes += sum(len(p.data) for p in packed_tensors(copied))
                if entry.pending_bytes > FLUSH_BYTES:
                    self._flush(entry)
        elif kind is Call.RESET:
            entry.epoch, entry.in_epoch = entry.epoch + 1, 0

    def _digest(self, entry: _Entry, inputs: Any) -> None:
        """The rows this update was fed, as digests in the stream of the entry's epoch (rank.row_digests)."""
        stream = entry.rows.get(entry.epoch)
        if stream is None:
            if not digested_epoch(entry.epoch):
                return
            if len(self.rows.streams) >= MAX_STREAMS:
                capped(Hook.METRICS_CAP, f"more than {MAX_STREAMS:,} metric epochs; later ones' rows were not digested")
                return
            stream = entry.rows[entry.epoch] = self.rows.stream()
        digests, rows = digest_rows(inputs, _TENSOR)
        self.rows.add(stream, digests, rows)

    def _keeps_compute(self, entry: _Entry, result: Any) -> bool:
        """Whether one more compute record (and its value) fits the rank's caps; past them, say so once."""
        size = _elements(result)
        if self.computes < MAX_COMPUTES and self.value_elements + size <= MAX_VALUE_ELEMENTS_KEPT:
            self.computes += 1
            self.value_elements += size
            return True
        capped(Hook.METRICS_CAP, f"more than {MAX_COMPUTES:,} compute() records or {MAX_VALUE_ELEMENTS_KEPT:,} result "
                                 f"elements; later compute() calls were not recorded")
        entry.info["note"] = entry.info["note"] or "distcheck's cap on compute() records was reached"
        return False

    def _compute(self, entry: _Entry, call: Callable[[], Any]) -> Any:
        try:
            k = entry.spilled + len(entry.computes)
            state = self._copy_state(entry.obj)
            point = _sync_point(entry.obj)
            t0 = time.time()
        except Exception as exc:   # rule 0: the user's compute() runs unrecorded
            self._unrecorded(entry.obj, exc)
            return call()
        result = call()
        try:
            self._computed(entry, k, state, point, t0, result)
        except Exception as exc:
            self._unrecorded(entry.obj, exc)
        return result

    def _unrecorded(self, obj: Any, exc: BaseException) -> None:
        """A call of ``obj`` went unrecorded (distcheck's own error, counted): what is recorded of ``obj`` no
        longer explains its states, so it is not replayed, and the report says why instead of blaming it."""
        failed(Hook.METRICS, exc)
        try:
            entry = self.entries.get(id(obj))
            if entry is not None and entry.obj is obj and not entry.info["note"]:
                message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                why = f"{type(exc).__name__}: {message}"
                entry.info["note"] = f"distcheck could not record one of its calls ({why})"[:300]
        except Exception:   # counted above; nothing more to do
            pass

    def _computed(self, entry: _Entry, k: int, state: dict | None, point: tuple | None, t0: float,
                  result: Any) -> None:
        """Record compute() number ``k`` of ``entry`` once it returned ``result``."""
        if not self._keeps_compute(entry, result):
            return
        value = jsonable(result)   # reading the value waits for an asynchronous backend's sync (NCCL)
        t1 = time.time()
        sync = None
        if point is not None:   # kept as a tuple (a dict per compute() costs more than the rest of the record)
            pg, ranks, seq, group_rank, rank = point
            ranks = self._shared.setdefault(tuple(ranks), tuple(ranks))
            sync = (ranks, seq, _seq(pg, seq), group_rank, rank, t0, t1)
        if state is not None and self.over_cap is None:
            entry.pending.append(("s", k, state))
        self._flush(entry)
        site = user_callsite()
        entry.computes.append((entry.epoch, entry.in_epoch, self._shared.setdefault(site, site), value, sync))
        if len(entry.computes) >= SPILL_COMPUTES:
            self._spill(entry)

    def _spill(self, entry: _Entry) -> None:
        """Write the object's compute records out, so a long run's thousands of passes hold none in memory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = spill_name(entry.key)
        append_computes(self.dir / name, [compute_record(c) for c in entry.computes])
        entry.info["computes_file"] = f"{self.dir.name}/{name}"
        entry.spilled += len(entry.computes)
        entry.computes.clear()

    def _entry(self, obj: Any, collection: bool) -> _Entry:
        entry = self.entries.get(id(obj))
        if entry is None or entry.obj is not obj:   # new, or an id reused after the first object was freed
            if entry is not None:
                self.retired.append(entry)
            number = len(self.entries) + len(self.retired)
            entry = self.entries[id(obj)] = _Entry(f"m{self._drains}-{number}", obj, collection)
            # Files are named relative to the launch's metrics folder (another node's arrive there); where
            # they were written is kept too (a batched scenario's launch dir is not the one they were written in).
            entry.info["written_in"] = str(self.dir.parent)
            entry.info["fresh"] = self._save_fresh(entry)
        return entry

    # -- copies and files ----------------------------------------------------------------

    def _save_fresh(self, entry: _Entry) -> str | None:
        """The object as it is before its first update (its initial state), pickled for the replay."""
        try:
            data = dumps_by_value(entry.obj)
        except Exception as exc:   # an unpicklable user attribute: no reference for this one
            entry.info["note"] = (f"could not copy it for the replay ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})")[:300]
            return None
        name = f"{entry.key}-fresh.pkl"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / name).write_bytes(data)
        return f"{self.dir.name}/{name}"

    def _copy_inputs(self, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
        if self.over_cap is not None:
            return None
        size = [0]
        copied = (_detached(args, size), _detached(kwargs, size))
        return copied if self._count(size[0]) else None

    def _copy_state(self, obj: Any) -> dict[str, Any] | None:
        """The object's local states before compute() syncs them (a collection's by member)."""
        if self.over_cap is not None:
            return None
        size = [0]
        state = {}
        for member, m in metrics_of(obj).items():
            for attr in getattr(m, "_defaults", {}):
                state[f"{member}.{attr}".lstrip(".")] = _detached(getattr(m, attr), size)
        return state if self._count(size[0]) else None

    def _count(self, nbytes: int) -> bool:
        if self.bytes + nbytes > self.cap:
            self._drop_inputs()
            return False
        self.bytes += nbytes
        return True

    def _drop_inputs(self) -> None:
        """Past the cap: forget every recorded input (never an OOM), keep results for the cross-rank check."""
        mb = self.cap / 2**20
        self.over_cap = (f"the recorded update() inputs passed this rank's {mb:g} MiB cap (--metric-memory-mb, "
                         f"{MEMORY_ENV}), so they were dropped")
        capped(Hook.METRICS_CAP, self.over_cap)
        for entry in [*self.retired, *self.entries.values()]:
            entry.pending.clear()
            entry.pending_bytes = 0
            entry.info["note"] = entry.info["note"] or self.over_cap

    def _flush(self, entry: _Entry) -> None:
        if not entry.pending or self.over_cap is not None:
            return
        name = f"{entry.key}-records-{self._chunks}.pkl"
        self._chunks += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "wb") as f:
            pickler(f).dump(entry.pending)
        entry.chunks.append(self._chunks - 1)
        entry.pending, entry.pending_bytes = [], 0

    def drain(self) -> list[dict[str, Any]]:
        """Every recorded object so far, forgotten afterwards (one scenario's, or the script's)."""
        out = []
        for entry in [*self.retired, *self.entries.values()]:
            try:
                self._flush(entry)
            except Exception as exc:   # an input that cannot be pickled: this object goes unchecked
                entry.info["note"] = entry.info["note"] or f"could not save its inputs ({type(exc).__name__}: {exc})"
            if self.over_cap:
                entry.info["note"] = entry.info["note"] or self.over_cap
            entry.info["rows"] = {str(epoch): self.rows.saved(s) for epoch, s in entry.rows.items()}
            entry.info["computes"] = [compute_record(c) for c in entry.computes]
            entry.info["chunks"] = [f"{self.dir.name}/{entry.key}-records-{n}.pkl" for n in entry.chunks]
            out.append(entry.info)
        self.entries, self.retired = {}, []
        self.rows.clear()
        self.computes = self.value_elements = 0
        self._shared = {}
        self._drains += 1
        return out


def _detached(x: Any, size: list[int]) -> Any:
    """A packed CPU copy of every tensor in ``x`` (never the caller's tensor), counting its bytes.
    On every update: no imports here, and exact types tried first."""
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(_detached(v, size) for v in x)
    if kind is dict:
        return {k: _detached(v, size) for k, v in x.items()}
    if _TENSOR is not None and isinstance(x, _TENSOR):
        size[0] += x.numel() * x.element_size()
        return pack(x)
    if isinstance(x, (list, tuple)):   # a named tuple or a list subclass: kept as a plain list
        return [_detached(v, size) for v in x]
    if isinstance(x, dict):
        return {k: _detached(v, size) for k, v in x.items()}
    return x


_TENSOR: Any = None   # torch.Tensor, once torchmetrics (hence torch) is imported
RECORDER: MetricRecorder | None = None


def _patch_metric(module: Any, existing: bool = False) -> None:
    """Record every Metric from now on; ``existing``: torchmetrics was in use before (instances may exist)."""
    global _TENSOR
    _TENSOR = sys.modules["torch"].Tensor
    cls = getattr(module, "Metric", None)
    if cls is None or getattr(cls._wrap_update, "__distcheck__", False):
        return
    wrap_update, wrap_compute, forward, reset = cls._wrap_update, cls._wrap_compute, cls.forward, cls.reset

    def _wrap_update(self: Any, update: Callable) -> Callable:
        inner = wrap_update(self, update)
        recorded: Any = functools.wraps(inner)(lambda *a, **k: _record(self, Call.UPDATE, lambda: inner(*a, **k), a, k))
        recorded.__distcheck__ = True
        return recorded

    def _wrap_compute(self: Any, compute: Callable) -> Callable:
        inner = wrap_compute(self, compute)
        recorded: Any = functools.wraps(inner)(lambda *a, **k: _record(self, Call.COMPUTE, lambda: inner(*a, **k)))
        recorded.__distcheck__ = True
        return recorded

    @functools.wraps(forward)
    def recorded_forward(self: Any, *a: Any, **k: Any) -> Any:   # forward = one update (plus a batch value)
        return _record(self, Call.UPDATE, lambda: forward(self, *a, **k), a, k)

    @functools.wraps(reset)
    def recorded_reset(self: Any) -> None:
        return _record(self, Call.RESET, lambda: reset(self))

    _wrap_update.__distcheck__ = _wrap_compute.__distcheck__ = True   # type: ignore[attr-defined]
    for name, value in (("_wrap_update", _wrap_update), ("_wrap_compute", _wrap_compute), ("forward", recorded_forward),
                        ("reset", recorded_reset)):
        _PATCHES.set(cls, name, value)
    if existing:
        _rewrap_existing(cls)


def _rewrap_existing(cls: type) -> None:
    """Metrics made before recording began (a rank of the user's own command becomes one at its
    ``init_process_group``; Lightning builds the model before that) hold update/compute wrapped
    at their ``__init__``: wrap them again, from the methods inside, so they are recorded too."""
    import gc

    classes, todo = set(), [cls]
    while todo:   # by exact type: isinstance() on every object of the heap takes seconds
        c = todo.pop()
        if c not in classes:
            classes.add(c)
            todo.extend(c.__subclasses__())
    for obj in gc.get_objects():
        if type(obj) not in classes:
            continue
        for name, wrap in (("update", obj._wrap_update), ("compute", obj._wrap_compute)):
            bound = obj.__dict__.get(name)
            inner = getattr(bound, "__wrapped__", None)
            if inner is not None and not getattr(bound, "__distcheck__", False):
                wrapped = wrap(inner)
                wrapped.__distcheck__ = True
                object.__setattr__(obj, name, wrapped)


def _patch_collection(module: Any) -> None:
    cls = getattr(module, "MetricCollection", None)
    if cls is None or getattr(cls.update, "__distcheck__", False):
        return
    for name, kind in (("update", Call.UPDATE), ("forward", Call.UPDATE), ("compute", Call.COMPUTE),
                       ("reset", Call.RESET)):
        original = getattr(cls, name)

        def recorded(self: Any, *a: Any, _original: Callable = original, _kind: Call = kind, **k: Any) -> Any:
            return _record(self, _kind, lambda: _original(self, *a, **k), a, k, collection=True)

        recorded = functools.wraps(original)(recorded)
        recorded.__distcheck__ = True   # type: ignore[attr-defined]
        _PATCHES.set(cls, name, recorded)


def _record(obj: Any, kind: Call, call: Callable[[], Any], args: tuple = (), kwargs: dict | None = None,
            collection: bool = False) -> Any:
    if RECORDER is None:
        return call()
    return RECORDER.call(obj, kind, call, args, kwargs, collection)


def cap_bytes() -> int:
    try:
        return int(float(os.environ.get(MEMORY_ENV, DEFAULT_MEMORY_MB)) * 2**20)
    except ValueError:
        return DEFAULT_MEMORY_MB * 2**20


_PATCHES = Patches()   # the rank's record of what distcheck replaced (``rank.patches``), once installed


def install(directory: Path, patches: Patches | None = None) -> None:
    """Record torchmetrics objects from the moment the user's code imports torchmetrics; what it replaces goes
    through ``patches``, whose undo also stops the recording (metrics wrapped before that record nothing more)."""
    global RECORDER, _PATCHES
    from distcheck.rank.integrations import _PostImportHook

    RECORDER, _PATCHES = MetricRecorder(directory, cap_bytes()), patches or Patches()
    hooks = {"torchmetrics.metric": _patch_metric, "torchmetrics.collections": _patch_collection}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name], existing=True) if hook is _patch_metric else hook(sys.modules[name])
    _PATCHES.finder(_PostImportHook(hooks, Hook.METRICS))
    _PATCHES.on_undo(_forget_recorder)


def _forget_recorder() -> None:
    global RECORDER, _PATCHES
    RECORDER, _PATCHES = None, Patches()


def results() -> dict[str, Any]:
    """What the launcher needs for the replay: every recorded object, and where to import their classes."""
    if RECORDER is None:
        return {}
    drained = RECORDER.drain()   # worker.finish_rank counts its failure (rule 0)
    return {"metrics": drained, "metrics_sys_path": list(sys.path)} if drained else {}


def aim(directory: Path) -> None:
    """A later generation of this process: its torchmetrics records go to its own files."""
    global RECORDER
    if RECORDER is not None:
        RECORDER = MetricRecorder(directory, cap_bytes())
