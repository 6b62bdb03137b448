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
"""

from __future__ import annotations

import functools
import os
import sys
import time
import weakref
from array import array
from pathlib import Path
from typing import Any

from distcheck.files.samples import append_pass
from distcheck.rank.guard import Hook, capped, failed

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


def lightning_context(max_depth: int = 80) -> tuple[str | None, dict[str, Any]]:
    """(stage, {setting: value}) of the Lightning Trainer whose loop is creating this iterator, if any.

    Found by walking up to a frame whose ``self`` has a Lightning ``trainer``: no
    Lightning import, and nothing when Lightning is not in the stack.
    """
    frame = sys._getframe(2)
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

        if getattr(loader, "_dataset_kind", None) != _DatasetKind.Map:
            self._iterable_pass(loader)
            return None
        try:
            size = len(loader.dataset)
        except TypeError:
            return None
        previous = self._open.pop(id(loader), None)
        if previous is not None:     # the loader's last pass was abandoned: a new one starts
            self._finish(previous)
        number, passes = self._loader_number(loader)
        name = f"{type(loader.dataset).__name__} (loader {number}, pass {passes})"
        try:
            expected = len(loader.sampler)   # what a full pass draws (DistributedSampler: padded share)
        except TypeError:
            expected = None
        stage, limits = lightning_context()
        record = {"dataset": name, "dataset_size": size, "ids": array("q"), "expected": expected, "complete": False,
                  "batches": 0, "batch_size": getattr(loader, "batch_size", None), "stage": stage, "limits": limits,
                  "sampler": index_source(loader), "t_start": time.time(), "drawn": 0}
        self._open[id(loader)] = record
        return record

    def _iterable_pass(self, loader: Any) -> None:
        """A pass over an ``IterableDataset``: no sampler tells its samples, so only that it started is written
        (the duplicates check then reads what the ranks fed their metrics instead: ``rank.row_digests``)."""
        number, passes = self._loader_number(loader)
        stage, _ = lightning_context()
        out = {"dataset": f"{type(loader.dataset).__name__} (loader {number}, pass {passes})", "iterable": True,
               "stage": stage, "t_start": time.time()}
        if self.path is None:
            self._done.append(out)
        else:
            append_pass(self.path, out)

    def _record(self, record: dict[str, Any], index: Any) -> None:
        record["batches"] += 1
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
        out = {k: record[k] for k in _RECORD_KEYS}
        out["ids"] = record["ids"].tolist()
        if record.get("ids_capped"):   # the pass drew more than it kept: its accounting is that of a cut pass
            out["complete"], out["ids_capped"] = False, record["drawn"]
        record["ids"] = array("q")     # the iterator may live on (its finalizer holds the record): free the ids
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

    def install(self) -> None:
        global ACTIVE
        from torch.utils.data.dataloader import _BaseDataLoaderIter

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
            try:
                index = original_next_index(self)
            except StopIteration:
                if record is not None:
                    record["complete"] = True
                    recorder._finish_guarded(record)
                raise
            if record is not None:
                try:
                    recorder._record(record, index)
                except Exception as exc:
                    failed(Hook.SAMPLES, exc)
            return index

        _BaseDataLoaderIter.__init__ = init
        _BaseDataLoaderIter._next_index = next_index


def _forget(loaders: dict[int, tuple[int, int, Any]], key: int, ref: Any) -> None:
    """A loader was freed: forget it (unless its id already names a newer loader)."""
    held = loaders.get(key)
    if held is not None and held[2] is ref:
        del loaders[key]


ACTIVE: SampleRecorder | None = None   # the rank's recorder, once installed


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
