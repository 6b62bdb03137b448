"""What a torchmetrics metric was fed, row by row, as cheap digests: the data side of the duplicates check.

Every ``update()`` (and ``forward``) hands a metric a batch: ``preds``, ``target`` and whatever else it
takes, each with the batch as its first dimension. A row's digest is one CRC-32 over that row's bytes in
every such tensor, in argument order, so the same sample fed on two ranks (an ``IterableDataset`` that
does not split its stream by rank) gives the same digest there, and ``diagnose.duplicates`` can find it
where no sampler says which samples a rank drew.

Bounded in cost and memory (rule 0): at most ``MAX_ROWS_PER_UPDATE`` rows of an update are digested,
and the digests a rank keeps are capped (``DISTCHECK_METRIC_ROWS``, default 262,144: 1 MiB). Past the
cap, the rank keeps only the rows whose digest has its lowest ``level`` bits zero, and raises the level
again when that fills up: a sample kept on one rank is kept on every rank, whatever their levels, once
the check brings them to the highest one. Reaching it is no loss of the check, so it is no coverage note.
"""

from __future__ import annotations

import os
import time
import zlib
from array import array
from typing import Any, Iterable

from distcheck.files.metric_records import PackedTensor, pack

ROWS_ENV = "DISTCHECK_METRIC_ROWS"
DEFAULT_ROWS = 262_144
MAX_ROWS_PER_UPDATE = 4_096


def rows_cap() -> int:
    try:
        return max(64, int(os.environ.get(ROWS_ENV, DEFAULT_ROWS)))
    except ValueError:
        return DEFAULT_ROWS


def packed_tensors(x: Any, tensor: type | None = None, rows: int | None = None) -> Iterable[PackedTensor]:
    """Every tensor in ``x`` (args or their packed copies), in order, as packed bytes of its first ``rows`` rows."""
    if isinstance(x, PackedTensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from packed_tensors(v, tensor, rows)
    elif isinstance(x, dict):
        for v in x.values():
            yield from packed_tensors(v, tensor, rows)
    elif tensor is not None and isinstance(x, tensor) and x.dim() >= 1:
        yield pack(x[:rows] if rows is not None else x)


def digest_rows(inputs: Any, tensor: type | None = None) -> tuple[array, int]:
    """(the digests of an update's first rows, how many rows it had). ``inputs``: the update's (args, kwargs),
    as the caller's tensors (``tensor``: their class) or as the recorder's packed copies."""
    parts = [p for p in packed_tensors(inputs, tensor, MAX_ROWS_PER_UPDATE) if p.shape]
    if not parts:
        return array("I"), 0
    batch = parts[0].shape[0]
    parts = [p for p in parts if p.shape[0] == batch]   # a per-update constant (a threshold tensor) is no row
    n = min(batch, MAX_ROWS_PER_UPDATE)
    views = [(memoryview(p.data), len(p.data) // max(p.shape[0], 1)) for p in parts]
    out = array("I")
    for i in range(n):
        h = 0
        for view, width in views:
            h = zlib.crc32(view[i * width:(i + 1) * width], h)
        out.append(h)
    return out, batch


class RowDigests:
    """The rank's kept digests, one stream per (metric, epoch), under one cap with hash sampling."""

    def __init__(self, cap: int) -> None:
        self.cap, self.level, self.kept = cap, 0, 0
        self.streams: list[dict[str, Any]] = []

    def stream(self) -> dict[str, Any]:
        """A new stream (a metric's updates since its last reset)."""
        s = {"t0": time.time(), "rows": 0, "digests": array("I")}
        self.streams.append(s)
        return s

    def add(self, stream: dict[str, Any], digests: array, rows: int) -> None:
        stream["rows"] += rows
        mask = (1 << self.level) - 1
        kept = digests if not mask else array("I", (d for d in digests if not d & mask))
        stream["digests"].extend(kept)
        self.kept += len(kept)
        while self.kept > self.cap and self.level < 32:
            self._raise_level()

    def _raise_level(self) -> None:
        self.level += 1
        mask = (1 << self.level) - 1
        self.kept = 0
        for s in self.streams:
            s["digests"] = array("I", (d for d in s["digests"] if not d & mask))
            self.kept += len(s["digests"])

    def saved(self, stream: dict[str, Any]) -> dict[str, Any]:
        """A stream as JSON (the rank's results): its digests, its row count and the level they were kept at."""
        return {"t0": stream["t0"], "rows": stream["rows"], "level": self.level,
                "digests": stream["digests"].tolist()}

    def clear(self) -> None:
        self.streams, self.level, self.kept = [], 0, 0


DIGESTED_EPOCHS = 16   # per metric: the first epochs' rows digested, then every power of two


def digested_epoch(epoch: int) -> bool:
    """Whether the rows of this epoch (updates between two resets) are digested: the first ``DIGESTED_EPOCHS``
    and then every power of two, the same on every rank, so a metric reset after each of thousands of
    evaluation passes keeps a few dozen streams."""
    return epoch < DIGESTED_EPOCHS or epoch & (epoch - 1) == 0
