"""Sample accounting inside a rank: which dataset indices each DataLoader pass draws.

No change to the user's code: the DataLoader iterator's ``_next_index`` (the one
place every sampler's indices pass through, for single- and multi-process
loading) is wrapped. Only indices are kept, never data. A *pass* is one
``iter(loader)``; passes are named by the order loaders are first iterated on
the rank, which is the same on every rank of an SPMD job.

A pass that stops before its sampler is exhausted (Lightning's sanity check,
``limit_val_batches``, ``max_steps``, a ``break``) is written too, marked
``complete: false``: its overlap between ranks is still a real duplicate, and
how much of the dataset it covered is reported. Such a pass is written when
its iterator is dropped, when its loader starts a new pass, or when the rank
finishes (``flush``), whichever comes first.

A map-style pass's indices say which samples a rank drew only if every rank's dataset holds the same rows: a
job that builds each rank its own dataset (its shard, indexed from 0 on every rank) draws coinciding indices of
different samples. So the first ``INDEXED_ROWS`` rows of such a pass are digested too, each beside the index it
was drawn at (``index_rows``), and ``diagnose.duplicates`` compares the rows behind a coinciding index before it
calls it a duplicate. A batch is paired with its indices in the order the loader yields them (it yields in the
order it drew them, its workers' batches included; a loader told ``in_order=False`` is not digested).

A pass over an ``IterableDataset`` draws no indices: there the batches the iterator yields are digested
instead (``rank.row_digests.batch_digests``: a few elements of each row, bounded per batch and per pass,
only read), so that ranks reading the same samples show, whatever their models make of them. Only the
first ``DIGESTED_EPOCHS`` passes of a loader and then every power-of-two one are digested.
"""

from __future__ import annotations

import functools
import os
from collections import deque
import sys
import time
import weakref
from array import array
from pathlib import Path
from types import FrameType
from typing import Any

from distcheck.files.samples import append_pass
from distcheck.rank.guard import Hook, capped, failed
from distcheck.rank.metric_sync import user_callsite
from distcheck.rank.patches import Patches
from distcheck.rank.row_digests import RowDigests, batch_digests, digested_epoch, pass_rows_cap

# Lightning's stage -> the Trainer setting that caps the batches of a pass in that stage
_LIGHTNING_LIMITS = {
    "sanity_check": ("sanity check", ("num_sanity_val_steps",)),
    "validate": ("validation", ("limit_val_batches",)),
    "train": ("training", ("limit_train_batches", "max_steps")),
    "test": ("test", ("limit_test_batches",)),
    "predict": ("prediction", ("limit_predict_batches",)),
}
_RECORD_KEYS = ("dataset", "dataset_size", "ids", "complete", "expected", "batches", "batch_size", "stage", "limits",
                "sampler", "t_start")
_SHARD_KEYS = ("sampler_rank", "sampler_replicas", "sampler_site")   # a DistributedSampler's, where it has them
INDEXED_ROWS = 256   # per map-style pass: rows digested beside their indices (what tells per-rank datasets apart)


def index_source(loader: Any) -> str | None:
    """``module.Class`` of what hands out the pass's indices: a batch sampler of its own (accelerate's
    ``BatchSamplerShard``, which pads with ``even_batches``) or else the sampler under torch's ``BatchSampler``."""
    try:
        from torch.utils.data import BatchSampler

        batch_sampler = getattr(loader, "batch_sampler", None)
        source = batch_sampler if batch_sampler is not None and type(batch_sampler) is not BatchSampler \
            else getattr(loader, "sampler", None)
        return None if source is None else f"{type(source).__module__}.{type(source).__qualname__}"
    except Exception:   # a loader of an odd shape: the pass is recorded without it
        return None


# Where each DistributedSampler was made (the user's line): a sampler told the wrong rank= is named by that line.
_SAMPLER_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sampler_shard(sampler: Any) -> dict[str, Any]:
    """The shard a DistributedSampler was told to draw (its ``rank`` and ``num_replicas``) and where it was made;
    nothing for any other sampler."""
    rank, replicas = getattr(sampler, "rank", None), getattr(sampler, "num_replicas", None)
    if not isinstance(rank, int) or not isinstance(replicas, int):
        return {}
    try:
        site = _SAMPLER_SITES.get(sampler)
    except TypeError:   # a sampler that cannot be weakly referenced
        site = None
    return {"sampler_rank": rank, "sampler_replicas": replicas, **({"sampler_site": site} if site else {})}


def _remembering_site(original: Any) -> Any:
    """``DistributedSampler.__init__`` that also remembers the user's line that made it (rule 0: the sampler is
    made as it is; a failure to remember is only counted)."""
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            site = user_callsite()   # the user's line that made the sampler
            if site:
                _SAMPLER_SITES[self] = site
        except Exception as exc:
            failed(Hook.SAMPLES, exc)

    return init


def lightning_context(max_depth: int = 80) -> tuple[str | None, dict[str, Any]]:
    """(stage, {setting: value}) of the Lightning Trainer whose loop is creating this iterator, if any.

    Found by walking up to a frame whose ``self`` has a Lightning ``trainer``: no
    Lightning import, and nothing when Lightning is not in the stack.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        trainer = getattr(owner, "trainer", None) if owner is not None else None
        if trainer is not None and type(trainer).__module__.split(".")[0] in ("lightning", "pytorch_lightning"):
            stage = getattr(getattr(trainer.state, "stage", None), "value", None)
            if stage in _LIGHTNING_LIMITS:
                name, settings = _LIGHTNING_LIMITS[stage]
                return name, {s: _plain(getattr(trainer, s, None)) for s in settings}
            return None, {}
        frame = frame.f_back
    return None, {}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


MAX_IDS_ENV = "DISTCHECK_SAMPLES_MAX_IDS"
DEFAULT_MAX_IDS = 1_000_000     # per pass: 8 MB of indices while the pass is open


def max_ids() -> int:
    try:
        return max(1, int(os.environ.get(MAX_IDS_ENV, DEFAULT_MAX_IDS)))
    except ValueError:
        return DEFAULT_MAX_IDS


class SampleRecorder:
    """``path``: where a script's passes go (JSON lines). None (scenarios): kept for ``drain``.

    Bounded memory (rule 0): loaders are held by weak references (a loader the user dropped is freed,
    its number never reused); a pass's indices are a compact array while the pass is open, capped at
    ``max_ids`` (``DISTCHECK_SAMPLES_MAX_IDS``); with a file, a pass is written when it ends and not
    kept. Reaching the cap is said once, as a ``coverage`` note (``guard.capped``).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.max_ids = max_ids()
        self._loaders: dict[int, tuple[int, int, Any]] = {}   # id(loader) -> (number, passes so far, weak ref)
        self._numbers = 0                                     # loaders seen so far (numbers are never reused)
        self._open: dict[int, dict[str, Any]] = {}       # id(loader) -> its pass not yet written
        self._done: list[dict[str, Any]] = []            # written passes, for drain() (scenarios only)

    def _loader_number(self, loader: Any) -> tuple[int, int]:
        """(the loader's number, its passes so far), counting this one; forgotten when the loader is freed."""
        key = id(loader)
        held = self._loaders.get(key)
        if held is None or held[2]() is not loader:   # new, or an id reused after its loader was freed
            held = (self._numbers, 0, weakref.ref(loader, functools.partial(_forget, self._loaders, key)))
            self._numbers += 1
        number, passes, ref = held
        self._loaders[key] = (number, passes + 1, ref)
        return number, passes

    def _new_pass(self, loader: Any) -> dict[str, Any] | None:
        from torch.utils.data.dataloader import _DatasetKind

        iterable = getattr(loader, "_dataset_kind", None) != _DatasetKind.Map
        try:
            size = None if iterable else len(loader.dataset)
        except TypeError:
            return None
        previous = self._open.pop(id(loader), None)
        if previous is not None:     # the loader's last pass was abandoned: a new one starts
            self._finish(previous)
        number, passes = self._loader_number(loader)
        name = f"{type(loader.dataset).__name__} (loader {number}, pass {passes})"
        if iterable:
            self._open[id(loader)] = record = self._iterable_pass(name, passes)
            return record
        try:
            expected = len(loader.sampler)   # what a full pass draws (DistributedSampler: padded share)
        except TypeError:
            expected = None
        stage, limits = lightning_context()
        record = {"dataset": name, "dataset_size": size, "ids": array("q"), "expected": expected, "complete": False,
                  "batches": 0, "batch_size": getattr(loader, "batch_size", None), "stage": stage, "limits": limits,
                  "sampler": index_source(loader), "t_start": time.time(), "drawn": 0,
                  **sampler_shard(getattr(loader, "sampler", None))}
        if digested_epoch(passes):
            record["index_rows"], record["pending"] = {}, deque()
        self._open[id(loader)] = record
        return record

    def _iterable_pass(self, name: str, passes: int) -> dict[str, Any]:
        """A pass over an ``IterableDataset``: no sampler tells its samples, so the rows its batches hold are
        digested as they are yielded (``_read``), in the first passes of a loader and then every power of two."""
        stage, _ = lightning_context()
        record = {"dataset": name, "iterable": True, "stage": stage, "t_start": time.time(), "batches": 0,
                  "complete": False}
        if digested_epoch(passes):
            record["digests"] = digests = RowDigests(pass_rows_cap())
            record["stream"] = digests.stream()
        return record

    def _read(self, record: dict[str, Any], batch: Any, collated: bool) -> None:
        """One batch an IterableDataset pass yielded: its rows' digests (the batch is only read)."""
        record["batches"] += 1
        digests = record.get("digests")
        if digests is not None and not record.get("written"):
            digests.add(record["stream"], *batch_digests(batch, collated))

    def _finish_iterable(self, record: dict[str, Any]) -> dict[str, Any]:
        out = {k: record[k] for k in ("dataset", "iterable", "stage", "t_start", "batches", "complete")}
        digests = record.pop("digests", None)
        if digests is not None:
            out["rows"] = digests.saved(record.pop("stream"))
        return out

    def _read_indexed(self, record: dict[str, Any], batch: Any, collated: bool) -> None:
        """One batch a map-style pass yielded: its first rows' digests beside the indices they were drawn at (the
        oldest indices not yet paired: a loader yields its batches in the order it drew them)."""
        pending, rows = record["pending"], record["index_rows"]
        if not pending:
            return
        index = pending.popleft()
        if index is not None and len(rows) < INDEXED_ROWS and not record.get("written"):
            digests, _ = batch_digests(batch, collated)
            for i, digest in zip(index if isinstance(index, (list, tuple)) else (index,), digests):
                if len(rows) >= INDEXED_ROWS:
                    break
                rows.setdefault(int(i), digest)
        if record.get("complete") and not pending:
            self._finish(record)   # its last batch is in: the pass is written now

    def _record(self, record: dict[str, Any], index: Any) -> None:
        record["batches"] += 1
        pending = record.get("pending")
        if pending is not None and len(record["index_rows"]) + len(pending) < INDEXED_ROWS:
            pending.append(index if isinstance(index, (list, tuple, int)) else None)
        ids = record["ids"]
        before = len(ids)
        if isinstance(index, (list, tuple)):
            record["drawn"] += len(index)
            room = self.max_ids - before
            ids.extend(int(i) for i in (index if len(index) <= room else index[:max(room, 0)]))
        elif isinstance(index, int):
            record["drawn"] += 1
            if before < self.max_ids:
                ids.append(index)
        if record["drawn"] > len(ids):
            self._capped(record)
        # Loops that count batches (Lightning) never ask past the last one: a pass is
        # complete as soon as it drew everything its sampler holds.
        if record["expected"] is not None and record["drawn"] >= record["expected"]:
            record["complete"] = True
            if not record.get("pending"):   # else written once the batches drawn are yielded (``_read_indexed``)
                self._finish(record)

    def _capped(self, record: dict[str, Any]) -> None:
        if not record.get("ids_capped"):
            record["ids_capped"] = True
            capped(Hook.SAMPLES_CAP, f"a DataLoader pass drew more than {self.max_ids:,} samples ({MAX_IDS_ENV}); "
                                     f"only its first {self.max_ids:,} indices were kept")

    def _finish(self, record: dict[str, Any]) -> None:
        if record.get("written"):
            return
        record["written"] = True
        for key, open_record in list(self._open.items()):
            if open_record is record:
                del self._open[key]
        if record.get("iterable"):
            self._write(self._finish_iterable(record))
            return
        out = {k: record[k] for k in _RECORD_KEYS}
        out.update((k, record[k]) for k in _SHARD_KEYS if k in record)
        out["ids"] = record["ids"].tolist()
        if record.get("index_rows"):
            out["index_rows"] = {str(i): d for i, d in record["index_rows"].items()}
        record.pop("pending", None)
        if record.get("ids_capped"):   # the pass drew more than it kept: its accounting is that of a cut pass
            out["complete"], out["ids_capped"] = False, record["drawn"]
        record["ids"] = array("q")     # the iterator may live on (its finalizer holds the record): free the ids
        self._write(out)

    def _write(self, out: dict[str, Any]) -> None:
        if self.path is None:
            self._done.append(out)
            return
        append_pass(self.path, out)

    def _finish_guarded(self, record: dict[str, Any]) -> None:
        """``_finish`` from the loader's own calls and finalizers: its failure counted, never raised."""
        try:
            self._finish(record)
        except Exception as exc:
            failed(Hook.SAMPLES, exc)

    def flush(self) -> None:
        """Write every pass still open (cut short, its iterator still alive)."""
        for record in list(self._open.values()):
            self._finish(record)

    def drain(self) -> list[dict[str, Any]]:
        """Every pass so far (open ones included), forgotten afterwards: one scenario's passes."""
        self.flush()
        done, self._done = self._done, []
        return done

    def install(self, patches: Patches | None = None) -> None:
        """Record the DataLoader's passes; what it replaces goes through ``patches`` (``rank.patches``), whose
        undo also forgets this recorder."""
        global ACTIVE
        from torch.utils.data.dataloader import (_BaseDataLoaderIter, _MultiProcessingDataLoaderIter,
                                                 _SingleProcessDataLoaderIter)

        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        ACTIVE = recorder = self
        original_init = _BaseDataLoaderIter.__init__
        original_next_index = _BaseDataLoaderIter._next_index

        # Rule 0: the loader's own methods run once and as they are; a recording error is only counted.
        @functools.wraps(original_init)
        def init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, loader, *args, **kwargs)
            try:
                self._distcheck_pass = record = recorder._new_pass(loader)
                if record is not None:   # an iterator dropped mid-pass (limit_val_batches, break) ends its pass
                    weakref.finalize(self, recorder._finish_guarded, record)
            except Exception as exc:
                failed(Hook.SAMPLES, exc)

        @functools.wraps(original_next_index)
        def next_index(self: Any) -> Any:
            record = getattr(self, "_distcheck_pass", None)
            if record is not None and record.get("iterable"):
                record = None    # its indices are none: its batches are read (``reading``)
            try:
                index = original_next_index(self)
            except StopIteration:
                if record is not None:
                    record["complete"] = True
                    if not record.get("pending"):   # else once the batches drawn are yielded (workers prefetch)
                        recorder._finish_guarded(record)
                raise
            if record is not None:
                try:
                    recorder._record(record, index)
                except Exception as exc:
                    failed(Hook.SAMPLES, exc)
            return index

        from torch.utils.data.distributed import DistributedSampler

        patches = patches if patches is not None else Patches()
        patches.set(DistributedSampler, "__init__", _remembering_site(DistributedSampler.__init__))
        patches.on_undo(_SAMPLER_SITES.clear)
        patches.set(_BaseDataLoaderIter, "__init__", init)
        patches.set(_BaseDataLoaderIter, "_next_index", next_index)
        for iterator in (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter):
            patches.set(iterator, "_next_data", _reading(recorder, iterator._next_data))
        patches.on_undo(_forget_active)


def _reading(recorder: SampleRecorder, original: Any) -> Any:
    """An iterator's ``_next_data`` that also digests what an IterableDataset pass yields (its own ``__next__``,
    warnings and profiler range included, stays as it is). Rule 0: the batch is returned as it came, the
    loader's own exceptions pass unchanged, and a recording error is only counted."""
    @functools.wraps(original)
    def next_data(self: Any) -> Any:
        record = getattr(self, "_distcheck_pass", None)
        if record is None:
            return original(self)
        if not record.get("iterable"):
            return _paired(recorder, record, self, original)
        try:
            data = original(self)
        except StopIteration:
            record["complete"] = True
            recorder._finish_guarded(record)
            raise
        try:
            recorder._read(record, data, bool(getattr(self, "_auto_collation", True)))
        except Exception as exc:
            failed(Hook.SAMPLES, exc)
        return data

    return next_data


def _paired(recorder: SampleRecorder, record: dict[str, Any], iterator: Any, original: Any) -> Any:
    """A map-style pass's batch, its first rows digested beside their indices while the pass still digests
    (``SampleRecorder._read_indexed``). Rule 0: the batch is returned as it came; a recording error is counted."""
    data = original(iterator)
    if record.get("pending") and getattr(iterator, "_in_order", True):
        try:
            recorder._read_indexed(record, data, bool(getattr(iterator, "_auto_collation", True)))
        except Exception as exc:
            failed(Hook.SAMPLES, exc)
    return data


def _forget(loaders: dict[int, tuple[int, int, Any]], key: int, ref: Any) -> None:
    """A loader was freed: forget it (unless its id already names a newer loader)."""
    held = loaders.get(key)
    if held is not None and held[2] is ref:
        del loaders[key]


ACTIVE: SampleRecorder | None = None   # the rank's recorder, once installed


def _forget_active() -> None:
    global ACTIVE
    ACTIVE = None


def aim(path: Path) -> None:
    """A later generation of this process: its DataLoader passes go to its own file."""
    if ACTIVE is not None:
        ACTIVE.path = path
        path.parent.mkdir(parents=True, exist_ok=True)


def drain() -> list:
    """The passes recorded since the last drain (a scenario's go out with its results)."""
    return ACTIVE.drain() if ACTIVE is not None else []


def flush() -> None:
    """Passes cut short whose iterators are still alive go out now (the rank is ending)."""
    if ACTIVE is not None:
        ACTIVE.flush()
