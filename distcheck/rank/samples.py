"""Sample accounting inside a rank: which dataset indices each DataLoader pass draws.

No change to the user's code: the DataLoader iterator's ``_next_index`` (the one
place every sampler's indices pass through, for single- and multi-process
loading) is wrapped. Only indices are kept, never data. A *pass* is one
``iter(loader)``; passes are named by the order loaders are first iterated on
the rank, which is the same on every rank of an SPMD job. Only passes that ran
to the end are written: a partial pass (Lightning's sanity check,
``limit_val_batches``) says nothing about samples that were never drawn.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any


class SampleRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._loaders: dict[int, tuple[int, int]] = {}   # id(loader) -> (loader number, passes so far)
        self._loader_refs: list[Any] = []                # keep ids unique while recording

    def _new_pass(self, loader: Any) -> dict[str, Any] | None:
        from torch.utils.data.dataloader import _DatasetKind

        if getattr(loader, "_dataset_kind", None) != _DatasetKind.Map:
            return None
        try:
            size = len(loader.dataset)
        except TypeError:
            return None
        number, passes = self._loaders.get(id(loader), (len(self._loaders), 0))
        if id(loader) not in self._loaders:
            self._loader_refs.append(loader)
        self._loaders[id(loader)] = (number, passes + 1)
        name = f"{type(loader.dataset).__name__} (loader {number}, pass {passes})"
        try:
            expected = len(loader.sampler)   # what a full pass draws (DistributedSampler: padded share)
        except TypeError:
            expected = None
        return {"dataset": name, "dataset_size": size, "ids": [], "expected": expected}

    def _record(self, record: dict[str, Any], index: Any) -> None:
        if isinstance(index, (list, tuple)):
            record["ids"].extend(int(i) for i in index)
        elif isinstance(index, int):
            record["ids"].append(index)
        # Loops that count batches (Lightning) never ask past the last one: a pass is
        # complete as soon as it drew everything its sampler holds.
        if record["expected"] is not None and len(record["ids"]) >= record["expected"]:
            self._finish(record)

    def _finish(self, record: dict[str, Any]) -> None:
        if record.get("written"):
            return
        record["written"] = True
        line = json.dumps({k: record[k] for k in ("dataset", "dataset_size", "ids")}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def install(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self.path.parent.mkdir(parents=True, exist_ok=True)
        recorder = self
        original_init = _BaseDataLoaderIter.__init__
        original_next_index = _BaseDataLoaderIter._next_index

        @functools.wraps(original_init)
        def init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, loader, *args, **kwargs)
            self._distcheck_pass = recorder._new_pass(loader)

        @functools.wraps(original_next_index)
        def next_index(self: Any) -> Any:
            record = getattr(self, "_distcheck_pass", None)
            try:
                index = original_next_index(self)
            except StopIteration:
                if record is not None:
                    recorder._finish(record)
                raise
            if record is not None:
                recorder._record(record, index)
            return index

        _BaseDataLoaderIter.__init__ = init
        _BaseDataLoaderIter._next_index = next_index


def read_samples(path: Path) -> list[dict[str, Any]]:
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
