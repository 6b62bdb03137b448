"""What a torchmetrics metric was fed, and what a DataLoader yielded, row by row, as cheap digests: the data
side of the duplicates check.

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

A DataLoader pass over an ``IterableDataset`` (no sampler tells its samples) is digested the same way, from
the batches the loader yields (``batch_digests``): the samples the rank *read*, whatever its model then
makes of them. A row there is read at ``ROW_ELEMENTS`` evenly spaced elements of each of its tensors (an
image batch is not read whole), only CPU tensors are read (never a device sync), and a pass keeps at most
``DISTCHECK_SAMPLE_ROWS`` digests (default 16,384: 64 KiB), with the same hash sampling past that.
"""

from __future__ import annotations

import os
import time
import zlib
from array import array
from collections.abc import Iterable
from typing import Any

from distcheck.files.metric_records import PackedTensor, pack

ROWS_ENV = "DISTCHECK_METRIC_ROWS"
DEFAULT_ROWS = 262_144
MAX_ROWS_PER_UPDATE = 4_096


def rows_cap() -> int:
    try:
        return max(64, int(os.environ.get(ROWS_ENV, DEFAULT_ROWS)))
    except ValueError:
        return DEFAULT_ROWS


def packed_tensors(x: Any, tensor: Any = None,   # torch.Tensor (torch is not followed: Any)
                   rows: int | None = None) -> Iterable[PackedTensor]:
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


# -- the rows a DataLoader yielded ---------------------------------------------------------------------------

PASS_ROWS_ENV = "DISTCHECK_SAMPLE_ROWS"
DEFAULT_PASS_ROWS = 16_384
ROW_ELEMENTS = 64        # elements read per row of each tensor, evenly spaced
MAX_FIELDS = 32          # tensors and string lists read per batch, in order
MAX_DEPTH = 4            # how deep a batch's lists, tuples and dicts are followed


def pass_rows_cap() -> int:
    try:
        return max(64, int(os.environ.get(PASS_ROWS_ENV, DEFAULT_PASS_ROWS)))
    except ValueError:
        return DEFAULT_PASS_ROWS


def batch_digests(batch: Any, collated: bool = True) -> tuple[array, int]:
    """(the digests of a yielded batch's first rows, how many rows it had). ``collated``: the loader batches
    samples (its first dimension is the batch); else the whole item is one sample. Only read: every op makes
    a new tensor of a few elements per row, with no autograd and no tensor subclass's own code run."""
    import torch

    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        fields = [f for f, _ in zip(_fields(batch, torch, 0), range(MAX_FIELDS))]
        if not fields:
            return array("I"), 0
        batch_size = (len(fields[0]) if isinstance(fields[0], list) else int(fields[0].shape[0])) if collated else 1
        n = min(batch_size, MAX_ROWS_PER_UPDATE)
        parts = [p for p in (_rows_of(f, batch_size, n, collated, torch) for f in fields) if p is not None]
    out = array("I")
    for i in range(n):
        h = 0
        for part in parts:
            if isinstance(part, list):
                h = zlib.crc32(part[i], h)
            else:
                data, width = part
                h = zlib.crc32(data[i * width:(i + 1) * width], h)
        out.append(h)
    return out, batch_size


def _fields(x: Any, torch: Any, depth: int) -> Iterable[Any]:
    """The batch's readable fields in order: plain CPU tensors, and lists of strings. Only the built-in containers
    are followed (a user's own mapping or sequence class may run code when read)."""
    if isinstance(x, torch.Tensor):
        if (type(x).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and x.layout == torch.strided
                and x.device.type == "cpu" and not x.is_nested and not x.is_quantized):
            yield x
    elif type(x) is str:
        yield [x]
    elif depth >= MAX_DEPTH:
        return
    elif type(x) is list or (isinstance(x, tuple) and type(x).__iter__ is tuple.__iter__):
        if x and all(type(v) is str for v in x):
            yield list(x)
        else:
            for v in x:
                yield from _fields(v, torch, depth + 1)
    elif type(x) is dict:
        for v in x.values():
            yield from _fields(v, torch, depth + 1)


def _rows_of(field: Any, batch_size: int, n: int, collated: bool, torch: Any) -> Any:
    """One field's first ``n`` rows: a list of bytes per row (strings), or (bytes, width) of a tensor's sampled
    elements; None when it has no row per sample (a per-batch constant)."""
    if isinstance(field, list):
        if collated and len(field) != batch_size:
            return None
        rows = field[:n] if collated else ["\x00".join(field)]
        return [s.encode("utf-8", "surrogatepass") for s in rows]
    if collated and (field.dim() == 0 or int(field.shape[0]) != batch_size):
        return None
    flat = field.detach()[:n].reshape(n, -1) if collated else field.detach().reshape(1, -1)
    m = int(flat.shape[1])
    if m > ROW_ELEMENTS:
        flat = flat.index_select(1, torch.arange(ROW_ELEMENTS) * (m - 1) // (ROW_ELEMENTS - 1))
    packed = pack(flat)
    return memoryview(packed.data), len(packed.data) // max(int(flat.shape[0]), 1)
