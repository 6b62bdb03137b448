"""Recording torchmetrics inside a rank, for a single-process reference after the launch.

When (and only when) the user's code imports torchmetrics, a post-import hook
wraps ``Metric.update``/``forward``/``compute``/``reset`` (through
``Metric._wrap_update``/``_wrap_compute``, which every instance goes through)
and the same methods of ``MetricCollection`` (compute groups included: the
collection's own update is what is recorded). Each recorded object keeps:

* a pickled fresh copy, taken before its first update (the replay's starting point);
* every ``update()``'s arguments as detached CPU copies (``torch.save``\\d to the
  launch dir at each ``compute()``), tagged with how many resets came before;
* every ``compute()``'s value and the user's line that asked for it.

The metric itself is never touched: inputs are copied, the original call runs
unchanged. Recorded inputs are capped per rank (``DISTCHECK_METRIC_MEMORY_MB``, default
256); past the cap the inputs are dropped with a note and
only the cross-rank comparison of results remains.
"""

from __future__ import annotations

import functools
import io
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

MEMORY_ENV = "DISTCHECK_METRIC_MEMORY_MB"
DEFAULT_MEMORY_MB = 256
MAX_VALUE_ELEMENTS = 65_536    # larger compute() results are compared by shape only
_LIBRARY_METRICS = ("lightning", "pytorch_lightning")   # Lightning's own self.log accumulators


class _Entry:
    """One recorded Metric or MetricCollection on this rank."""

    def __init__(self, key: str, obj: Any, collection: bool) -> None:
        cls = type(obj)
        self.key, self.obj, self.collection = key, obj, collection
        self.info: dict[str, Any] = {
            "id": key, "class": cls.__name__, "module": cls.__module__, "qualname": cls.__qualname__,
            "file": getattr(sys.modules.get(cls.__module__), "__file__", None), "collection": collection,
            "sync_on_compute": getattr(obj, "sync_on_compute", None), "fresh": None, "chunks": [],
            "updates": 0, "computes": [], "note": None,
        }
        self.epoch = 0            # resets so far
        self.in_epoch = 0         # updates since the last reset
        self.pending: list[tuple[int, Any, Any]] = []


class MetricRecorder:
    def __init__(self, directory: Path, cap_bytes: int) -> None:
        self.dir, self.cap = directory, cap_bytes
        self.entries: dict[int, _Entry] = {}
        self.members: set[int] = set()       # metrics updated through a collection: the collection is checked
        self.bytes = 0
        self.over_cap: str | None = None
        self._local = threading.local()
        self._chunks = 0
        self._drains = 0     # file names stay unique across the scenarios of a batched launch

    # -- the wrapped calls -------------------------------------------------------------

    def busy(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def call(self, obj: Any, kind: str, call: Callable[[], Any], args: tuple = (), kwargs: dict | None = None,
             collection: bool = False) -> Any:
        """Run the user's call; record it unless it is nested in another recorded call."""
        if self.busy() or type(obj).__module__.split(".")[0] in _LIBRARY_METRICS:
            return call()
        self._local.depth = 1
        try:
            entry = self._entry(obj, collection)
            copied = self._copy_inputs(args, kwargs or {}) if kind == "update" and entry else None
            result = call()
            if entry is not None:
                self._after(entry, kind, copied, result)
            return result
        finally:
            self._local.depth = 0

    def _after(self, entry: _Entry, kind: str, copied: Any, result: Any) -> None:
        if kind == "update":
            entry.info["updates"] += 1
            entry.in_epoch += 1
            if copied is not None and self.over_cap is None:
                entry.pending.append((entry.epoch, *copied))
            if entry.collection:
                self.members.update(id(m) for m in entry.obj.values())
        elif kind == "reset":
            entry.epoch, entry.in_epoch = entry.epoch + 1, 0
        elif kind == "compute" and id(entry.obj) not in self.members:
            self._flush(entry)
            entry.info["computes"].append({"epoch": entry.epoch, "updates": entry.in_epoch,
                                           "callsite": user_callsite(), "value": jsonable(result)})

    def _entry(self, obj: Any, collection: bool) -> _Entry | None:
        entry = self.entries.get(id(obj))
        if entry is None:
            entry = self.entries[id(obj)] = _Entry(f"m{len(self.entries)}", obj, collection)
            entry.info["fresh"] = self._save_fresh(entry)
        return entry

    # -- copies and files ----------------------------------------------------------------

    def _save_fresh(self, entry: _Entry) -> str | None:
        """The object as it is before its first update (its initial state), pickled for the replay."""
        import torch

        buf = io.BytesIO()
        try:
            torch.save(entry.obj, buf)
        except Exception as exc:   # an unpicklable user attribute: no reference for this one
            entry.info["note"] = f"could not copy it for the replay ({type(exc).__name__}: {exc})"[:300]
            return None
        path = self.dir / f"{self._drains}-{entry.key}-fresh.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
        return str(path)

    def _copy_inputs(self, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
        if self.over_cap is not None:
            return None
        size = [0]
        copied = (_detached(args, size), _detached(kwargs, size))
        if self.bytes + size[0] > self.cap:
            self._drop_inputs()
            return None
        self.bytes += size[0]
        return copied

    def _drop_inputs(self) -> None:
        """Past the cap: forget every recorded input (never an OOM), keep results for the cross-rank check."""
        mb = self.cap / 2**20
        self.over_cap = (f"recorded update() inputs passed this rank's {mb:g} MiB cap ({MEMORY_ENV}), "
                         f"so the single-process reference was skipped")
        for entry in self.entries.values():
            entry.pending.clear()
            entry.info["note"] = entry.info["note"] or self.over_cap

    def _flush(self, entry: _Entry) -> None:
        import torch

        if not entry.pending or self.over_cap is not None:
            return
        path = self.dir / f"{self._drains}-{entry.key}-updates-{self._chunks}.pt"
        self._chunks += 1
        torch.save(entry.pending, path)
        entry.info["chunks"].append(str(path))
        entry.pending = []

    def drain(self) -> list[dict[str, Any]]:
        """Every recorded object so far, forgotten afterwards (one scenario's, or the script's)."""
        out = []
        for entry in self.entries.values():
            if id(entry.obj) in self.members and not entry.info["computes"]:
                continue
            self._flush(entry)
            if self.over_cap:
                entry.info["note"] = entry.info["note"] or self.over_cap
            out.append(entry.info)
        self.entries, self.members = {}, set()
        self._drains += 1
        return out


def _detached(x: Any, size: list[int]) -> Any:
    """A CPU copy of every tensor in ``x`` (never the caller's tensor), counting its bytes."""
    import torch

    if isinstance(x, torch.Tensor):
        size[0] += x.numel() * x.element_size()
        return x.detach().to("cpu", copy=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v, size) for v in x) if type(x) in (list, tuple) else [_detached(v, size) for v in x]
    if isinstance(x, dict):
        return {k: _detached(v, size) for k, v in x.items()}
    return x


def jsonable(value: Any) -> Any:
    """A compute() result as JSON: tensors as nested lists (large ones by shape only)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_VALUE_ELEMENTS:
            return {"shape": list(value.shape), "too_large": True}
        return value.detach().cpu().double().tolist() if value.is_floating_point() else value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return repr(value)[:200]


def user_callsite() -> str | None:
    """file:line:function of the innermost frame of the user's own code."""
    from distcheck.files.stacks import USER, classify_file, torch_dir

    tdir = torch_dir()
    frame = sys._getframe(1)
    while frame is not None:
        if classify_file(frame.f_code.co_filename, tdir) == USER:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


RECORDER: MetricRecorder | None = None
_MODULES = ("torchmetrics.metric", "torchmetrics.collections")


def _patch_metric(module: Any) -> None:
    cls = getattr(module, "Metric", None)
    if cls is None or getattr(cls._wrap_update, "__distcheck__", False):
        return
    wrap_update, wrap_compute, forward, reset = cls._wrap_update, cls._wrap_compute, cls.forward, cls.reset

    def _wrap_update(self: Any, update: Callable) -> Callable:
        inner = wrap_update(self, update)
        return functools.wraps(inner)(lambda *a, **k: _record(self, "update", lambda: inner(*a, **k), a, k))

    def _wrap_compute(self: Any, compute: Callable) -> Callable:
        inner = wrap_compute(self, compute)
        return functools.wraps(inner)(lambda *a, **k: _record(self, "compute", lambda: inner(*a, **k)))

    @functools.wraps(forward)
    def recorded_forward(self: Any, *a: Any, **k: Any) -> Any:   # forward = one update (plus a batch value)
        return _record(self, "update", lambda: forward(self, *a, **k), a, k)

    @functools.wraps(reset)
    def recorded_reset(self: Any) -> None:
        return _record(self, "reset", lambda: reset(self))

    _wrap_update.__distcheck__ = True   # type: ignore[attr-defined]
    cls._wrap_update, cls._wrap_compute, cls.forward, cls.reset = (_wrap_update, _wrap_compute, recorded_forward,
                                                                   recorded_reset)


def _patch_collection(module: Any) -> None:
    cls = getattr(module, "MetricCollection", None)
    if cls is None or getattr(cls.update, "__distcheck__", False):
        return
    for name, kind in (("update", "update"), ("forward", "update"), ("compute", "compute"), ("reset", "reset")):
        original = getattr(cls, name)

        def recorded(self: Any, *a: Any, _original: Callable = original, _kind: str = kind, **k: Any) -> Any:
            return _record(self, _kind, lambda: _original(self, *a, **k), a, k, collection=True)

        recorded = functools.wraps(original)(recorded)
        recorded.__distcheck__ = True   # type: ignore[attr-defined]
        setattr(cls, name, recorded)


def _record(obj: Any, kind: str, call: Callable[[], Any], args: tuple = (), kwargs: dict | None = None,
            collection: bool = False) -> Any:
    if RECORDER is None:
        return call()
    return RECORDER.call(obj, kind, call, args, kwargs, collection)


def cap_bytes() -> int:
    try:
        return int(float(os.environ.get(MEMORY_ENV, DEFAULT_MEMORY_MB)) * 2**20)
    except ValueError:
        return DEFAULT_MEMORY_MB * 2**20


def install(directory: Path) -> None:
    """Record torchmetrics objects from the moment the user's code imports torchmetrics."""
    global RECORDER
    from distcheck.rank.integrations import _PostImportHook

    RECORDER = MetricRecorder(directory, cap_bytes())
    hooks = {"torchmetrics.metric": _patch_metric, "torchmetrics.collections": _patch_collection}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _PostImportHook(hooks))


def results() -> dict[str, Any]:
    """What the launcher needs for the replay: every recorded object, and where to import their classes."""
    if RECORDER is None:
        return {}
    drained = RECORDER.drain()
    return {"metrics": drained, "metrics_sys_path": list(sys.path)} if drained else {}
