"""JSON renderer: the versioned report schema (``distcheck.report/1``).

Bounded at scale: a list of plain values (a finding's ranks, a call's shapes) stays on one line, and a
call's ``group_ranks`` of more than ``models.RUNS_ABOVE`` ranks is written as runs of consecutive ranks
(``models.rank_runs``: ``[[0, 4095]]``; ``models.ranks_from_json`` reads both forms). Every rank's last
call names its whole group: at 4,096 ranks, one rank per line made that part alone hundreds of MB.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

from distcheck.models import Report, bounded


def render(report: Report) -> str:
    return _dump(bounded(report.to_dict()), 0) + "\n"


def _flat(value: list | tuple) -> bool:
    return all(not isinstance(v, (dict, list, tuple)) or (isinstance(v, (list, tuple)) and _flat(v)) for v in value)


def _dump(value: Any, level: int) -> str:
    """``json.dumps(indent=2)``, except that a list holding no objects is written on one line."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = "  " * (level + 1)
        items = [f"{pad}{encode_basestring_ascii(str(k))}: {_dump(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    if isinstance(value, (list, tuple)):
        if not value or _flat(value):
            return json.dumps(value)
        pad = "  " * (level + 1)
        return "[\n" + ",\n".join(pad + _dump(v, level + 1) for v in value) + "\n" + "  " * level + "]"
    return _scalar(value)


_WORDS = {None: "null", True: "true", False: "false"}


def _scalar(value: Any) -> str:
    """``json.dumps`` of one plain value, its common types without the encoder's set-up (a 4,096-rank report
    has half a million of them)."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is int:
        return int.__repr__(value)
    if value is None or kind is bool:
        return _WORDS[value]
    return json.dumps(value)
