"""nccl-tests' definitions: each op's buffer sizes, algorithm bandwidth and bus bandwidth. Pure.

Taken from nccl-tests (``doc/PERFORMANCE.md`` and each ``src/<op>.cu``'s ``GetCollByteCount`` and
``GetBw``), so a row of distcheck's table reads the same as a row of ``<op>_perf``'s:

* a swept size is read as ``size / element size`` elements; where the op splits its buffer into one
  slice per rank (all_gather, reduce_scatter, all_to_all) the slice is ``(count / nranks)`` rounded
  down to a multiple of 16 bytes: ``(count/nranks) & ~(16/eltSize - 1)``, so at small sizes or rank
  counts that are not powers of two a row's size is below the swept one, and can be 0;
* the *size* column is the larger of a rank's send and receive buffers in bytes (for all_gather the
  whole gathered buffer, for reduce_scatter the whole input, for all_to_all the whole buffer);
* *count* is the element count passed to the call (per rank for all_gather / reduce_scatter, per
  peer for all_to_all);
* ``algbw = S / t`` and ``busbw = algbw × factor`` with S and the factor below, in GB/s (10⁹ B/s);
* the sizes visited with ``-b min -e max -f factor`` are ``min, min×factor, …`` up to ``max``, the
  factor a whole number (nccl-tests reads ``-f`` with ``strtol``).
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
# nccl-tests splits these ops' buffer into one slice per rank (S = count × n × element size)
_SPLIT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
_REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})
_ROOTED = frozenset({"broadcast", "reduce"})
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}   # nccl-tests' parsesize


@dataclass(frozen=True)
class Counts:
    """Element counts of one call, as nccl-tests' ``<op>GetCollByteCount`` sets them."""

    send: int    # a rank's input buffer
    recv: int    # a rank's output buffer
    param: int   # the count passed to the call: nccl-tests' ``count`` column


ALIGN_BYTES = 16   # nccl-tests keeps each rank's slice of a split buffer a multiple of 16 bytes


def slice_count(count: int, element_size: int, n: int) -> int:
    """One rank's slice of ``count`` elements split over ``n`` ranks, as nccl-tests computes it:
    ``(count/nranks) & ~(16/eltSize - 1)`` — rounded down to a multiple of 16 bytes."""
    align = max(ALIGN_BYTES // element_size, 1)   # 16/eltSize is a power of two for every NCCL type
    return (count // n) // align * align


def counts(op: str, size_bytes: int, element_size: int, n: int) -> Counts:
    """The buffers of ``op`` at nccl-tests' swept ``size`` (bytes) on ``n`` ranks."""
    count = size_bytes // element_size
    per_rank = slice_count(count, element_size, n)
    if op == "all_gather":
        return Counts(send=per_rank, recv=per_rank * n, param=per_rank)
    if op == "reduce_scatter":
        return Counts(send=per_rank * n, recv=per_rank, param=per_rank)
    if op == "all_to_all":
        return Counts(send=per_rank * n, recv=per_rank * n, param=per_rank)
    _known(op)
    return Counts(send=count, recv=count, param=count)


def size_column(c: Counts, element_size: int) -> int:
    """nccl-tests' ``size`` column: ``max(sendBytes, expectedBytes)``."""
    return max(c.send, c.recv) * element_size


def message_bytes(op: str, param: int, element_size: int, n: int) -> int:
    """S of ``algbw = S / t``: the count × element size, times n for the split ops (nccl-tests' GetBw)."""
    return param * element_size * (n if _known(op) in _SPLIT else 1)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw factor: what each rank's links carry relative to S (PERFORMANCE.md)."""
    if _known(op) == "all_reduce":
        return 2 * (n - 1) / n
    if op in _SPLIT:
        return (n - 1) / n
    return 1.0   # broadcast, reduce, sendrecv


def algbw(op: str, param: int, element_size: int, seconds: float, n: int) -> float:
    """GB/s: S / t."""
    return message_bytes(op, param, element_size, n) / 1e9 / seconds


def busbw(op: str, param: int, element_size: int, seconds: float, n: int) -> float:
    """GB/s: algbw × the op's bus factor."""
    return algbw(op, param, element_size, seconds, n) * bus_factor(op, n)


def redop(op: str) -> str:
    """nccl-tests' ``redop`` column."""
    return "sum" if _known(op) in _REDUCING else "none"


def root(op: str) -> int:
    """nccl-tests' ``root`` column: rank 0 for the rooted ops, -1 otherwise."""
    return 0 if _known(op) in _ROOTED else -1


def sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """The sizes nccl-tests visits with ``-b min -e max -f factor``: ``size *= factor`` while ``size <= max``."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor <= 1:
        raise ValueError(f"a sweep needs 0 < min <= max and factor > 1 (got min {min_bytes}, max {max_bytes}, "
                         f"factor {factor:g})")
    if not float(factor).is_integer():
        raise ValueError(f"step_factor must be a whole number, as nccl-tests' -f is (got {factor:g})")
    sizes, size, step = [], int(min_bytes), int(factor)
    while size <= max_bytes:
        sizes.append(size)
        size *= step
    return sizes


def parse_size(value: object) -> int:
    """A byte count as nccl-tests reads ``-b``/``-e``: a number, optionally with K, M, G or T (powers of 1024)."""
    text = str(value).strip().upper().removesuffix("B")
    scale = _SUFFIX.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale > 1 else text)
    except ValueError:
        raise ValueError(f"not a size: {value!r} (use bytes, or a number with K, M or G)") from None
    if number <= 0:
        raise ValueError(f"a size must be greater than 0 (got {value!r})")
    return int(number * scale)


def parse_floors(value: object) -> dict[str, float]:
    """``--min-busbw``: one GB/s floor for every op ("10"), or per op ("all_reduce=10,all_gather=8").
    A single number is returned under the key ``"*"``."""
    text = str(value).strip()
    floors: dict[str, float] = {}
    for part in text.split(","):
        op, _, number = part.strip().rpartition("=") if "=" in part else ("*", "", part.strip())
        op = op.strip()
        if op != "*" and op not in OPS:
            raise ValueError(f"--min-busbw: unknown op {op!r}; use one of {', '.join(OPS)}")
        try:
            floors[op] = float(number)
        except ValueError:
            raise ValueError(f"--min-busbw: not a number of GB/s: {number.strip()!r}") from None
        if floors[op] <= 0:
            raise ValueError(f"--min-busbw must be greater than 0 (got {floors[op]:g} for {op})")
    return floors


def floor_of(floors: dict[str, float], op: str) -> float | None:
    """The floor ``op`` must reach: its own, else the one for every op."""
    return floors.get(op, floors.get("*"))


def _known(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
    return op
