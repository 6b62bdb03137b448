"""Ranks as runs of consecutive ranks (``[[0, 4095]]``): how a long group's members cross to report.json and to
the other nodes, and how they are read back."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any


def rank_runs(ranks: Sequence[Any]) -> list[list[int]] | Sequence[Any]:
    """Ranks as runs of consecutive ranks (``[[0, 4095]]``): how report.json writes a long ``group_ranks``
    and a node publishes a call's members. ``ranks_from_json`` reads them back. A list that is not plain
    ranks (already runs) is returned as it is."""
    if not ranks:
        return []
    first, last = ranks[0], ranks[-1]
    if (type(first) is int and type(last) is int and last - first + 1 == len(ranks)
            and list(ranks) == list(range(first, last + 1))):   # the common case (a whole group), at C speed
        return [[first, last]]
    out: list[list[int]] = []
    for r in ranks:
        if not isinstance(r, int):
            return ranks
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def shorter_form(ranks: Sequence[Any]) -> list[Any] | Sequence[Any]:
    """Ranks as runs, or as they are where that is shorter: a strided group (a DeviceMesh's DP group, every 32nd
    rank) is no run at all, and as pairs it was twice its list. ``ranks_from_json`` reads either."""
    runs = rank_runs(ranks)
    return runs if runs is ranks or 2 * len(runs) < len(ranks) else list(ranks)


RUNS_ABOVE = 16   # a longer ``group_ranks`` is written as runs


def bounded(value: Any) -> Any:
    """A report's data (or a scenario's) with every long ``group_ranks`` as runs: how it crosses to
    report.json and to the other nodes."""
    return _bounded(value, {})


def _bounded(value: Any, runs: dict[int, tuple[Any, Any]]) -> Any:
    # ``runs``: the runs of each group's members by identity: every rank's last call and fingerprint name its
    # group by one shared tuple (decoded once per distinct text), and at 4,096 ranks cutting each again took 1 s
    if isinstance(value, dict):
        return {k: (_runs_of(v, runs) if k == "group_ranks" and isinstance(v, (list, tuple)) and len(v) > RUNS_ABOVE
                    else _bounded(v, runs)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bounded(v, runs) for v in value]
    return value


def _runs_of(ranks: Sequence[Any], runs: dict[int, tuple[Any, Any]]) -> Any:
    seen = runs.get(id(ranks))
    if seen is None or seen[0] is not ranks:
        seen = runs[id(ranks)] = (ranks, shorter_form(ranks))
    return seen[1]


def ranks_from_json(value: Any) -> tuple[int, ...]:
    """A list of ranks as report.json writes it: plain, or as runs of consecutive ranks (``[[0, 4095]]``,
    ``rank_runs``' form). The same runs read back as one shared tuple: every rank's last call names its group,
    and a tuple each was 268 M ranks (80 s, 4 GB) reading a 16,384-rank report."""
    value = value or ()
    if value and isinstance(value[0], (list, tuple)):
        return _expanded(tuple(map(tuple, value)))
    return _first_of(tuple(value)) if len(value) > RUNS_ABOVE else tuple(value)


@functools.lru_cache(maxsize=4096)
def _first_of(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The first equal tuple read: a strided group (a DP group) is written plain, and shared like runs."""
    return ranks


@functools.lru_cache(maxsize=4096)
def _expanded(runs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(itertools.chain.from_iterable(range(a, b + 1) for a, b in runs))
