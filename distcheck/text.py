"""Small wording helpers shared by analysis summaries and renderers."""

from __future__ import annotations

import os
from typing import Any, Iterable


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 0', 'ranks 1, 2, 3', 'ranks 0-15' for long runs."""
    rs = sorted(set(ranks))
    if not rs:
        return "no rank"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if len(rs) > 4 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
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


def site(callsite: str | None) -> str:
    """'file.py:23' (function dropped) for sentences."""
    if not callsite:
        return "an unknown place"
    parts = short_path(callsite).rsplit(":", 1)
    return parts[0] if len(parts) == 2 and not parts[1].isdigit() else short_path(callsite)


def field_value(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name == "shapes":
        return ", ".join("[" + ", ".join(map(str, s)) + "]" for s in value) or "no tensor"
    if name == "dtypes":
        return ", ".join(value) or "no tensor"
    if name == "group":
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def plural(n: int, word: str, plural_word: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural_word or word + 's')}"
