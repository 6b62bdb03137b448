"""Small wording helpers shared by analysis summaries and renderers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 0', 'ranks 1, 2, 3', 'ranks 0-15' for long runs, and past 8 ranks runs everywhere
    ('ranks 0-4058, 4060-4095': a large job's sentence stays one line, not 4,095 numbers)."""
    rs = sorted(set(ranks))
    if not rs:
        return "no rank"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if len(rs) > 4 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    if len(rs) > 8:
        return "ranks " + id_list(rs, limit=len(rs))
    return "ranks " + ", ".join(map(str, rs))


def short_path(path: str | None, base: str | None = None) -> str:
    """A call site relative to the working directory when it lies below it."""
    if not path:
        return "?"
    base = base or os.getcwd()
    file, sep, rest = path.partition(":")
    try:
        rel = os.path.relpath(file, base)
    except ValueError:
        rel = file
    if not rel.startswith(".."):
        file = rel
    return f"{file}{sep}{rest}"


def call_site(file: str, line: int | str, function: str) -> str:
    """'file.py:23:main': a frame as every record, status, stack reading and finding names it (``site`` and
    ``short_path`` read it back)."""
    return f"{file}:{line}:{function}"


def site(callsite: str | None) -> str:
    """'file.py:23' (function dropped) for sentences."""
    if not callsite:
        return "an unknown place"
    parts = short_path(callsite).rsplit(":", 1)
    return parts[0] if len(parts) == 2 and not parts[1].isdigit() else short_path(callsite)


def field_value(name: str, value: Any) -> str:
    """A fingerprint field's value as a reader wants it: shapes as [3, 3], groups as their ranks."""
    if value is None:
        return "none"
    if name in ("shape", "shapes"):
        return ", ".join("[" + ", ".join(map(str, s)) + "]" for s in value) or "no tensor"
    if name in ("dtype", "dtypes"):
        return ", ".join(value) or "no tensor"
    if name in ("group", "group_ranks"):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def plural(n: int, word: str, plural_word: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural_word or word + 's')}"


def id_list(ids: Iterable[int], limit: int = 20) -> str:
    """'0-7, 9, 12-15': sorted ids with runs compacted, at most ``limit`` items."""
    xs = sorted(set(ids))
    runs: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        runs.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}" if j > i + 1 else f"{xs[i]}, {xs[j]}")
        i = j + 1
    shown = ", ".join(runs[:limit])
    return shown + (", ..." if len(runs) > limit else "")


def signed(x: float) -> str:
    """'+1', '-0.125': a difference with its sign."""
    text = f"{x:+.6g}"
    return text[:-2] if text.endswith(".0") else text


def gib(n: int) -> str:
    """Bytes as MiB below a GiB, else GiB with one decimal."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def size(n: int) -> str:
    """Bytes in any amount: B and KiB below a MiB (a trickle of I/O), ``gib`` from there on."""
    if n >= 2**20:
        return gib(n)
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


# What a failed start prints first: the interpreter's own (``can't open file``), a traceback's last line, a
# launcher's error line. A launcher's later report of its children's end (torchrun's ChildFailedError banner)
# says less than the first.
_ERROR_MARKS = ("can't open file", "No such file", "Error:", "Error", "error:", "not found", "cannot ")


def first_error_line(output: str) -> str:
    """The line of a command's output that says why it failed: the first that reads as an error, else its last."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = next((line for line in lines if any(mark in line for mark in _ERROR_MARKS)
                  and not line.startswith(("Traceback", "File ", "raise "))), None)
    return (found or (lines[-1] if lines else ""))[:200]
