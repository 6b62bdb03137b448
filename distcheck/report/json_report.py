"""JSON renderer: the versioned report schema (``distcheck.report/1``, or /2 for a job of many ranks).

Bounded at scale: a list of plain values (a finding's ranks, a call's shapes) stays on one line, and a
call's ``group_ranks`` of more than ``models.RUNS_ABOVE`` ranks is written as runs of consecutive ranks
(``models.rank_runs``: ``[[0, 4095]]``; ``models.ranks_from_json`` reads both forms). Every rank's last
call names its whole group: at 4,096 ranks, one rank per line made that part alone hundreds of MB. A job of
more than ``models.SHARE_ABOVE`` ranks is written in the shared form (``Report.as_written``), each rank's row
and each finding's rank detail on a line of its own: indented, a row's forty fields were most of its bytes.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

from distcheck.models import Report, ReportSchema


def render(report: Report) -> str:
    data = report.as_written()
    return _dump(data, 0, data["schema"] == ReportSchema.SHARED) + "\n"


def _flat(value: list | tuple) -> bool:
    return all(not isinstance(v, (dict, list, tuple)) or (isinstance(v, (list, tuple)) and _flat(v)) for v in value)


def _dump(value: Any, level: int, rows_in_line: bool = False) -> str:
    """``json.dumps(indent=2)``, except that a list holding no objects is written on one line, and with
    ``rows_in_line`` each object of a ``ranks`` or ``calls`` list (a rank's row, a finding's rank detail, a call
    ranks share) too, without spaces: 16,384 of them."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = "  " * (level + 1)
        items = [f"{pad}{encode_basestring_ascii(str(k))}: "
                 + (_rows(v, level + 1) if rows_in_line and k in _ONE_LINE_EACH and isinstance(v, list)
                    else _dump(v, level + 1, rows_in_line)) for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    if isinstance(value, (list, tuple)):
        if not value or _flat(value):
            return json.dumps(value)
        pad = "  " * (level + 1)
        return ("[\n" + ",\n".join(pad + _dump(v, level + 1, rows_in_line) for v in value) + "\n"
                + "  " * level + "]")
    return _scalar(value)


_ONE_LINE_EACH = frozenset({"ranks", "calls"})   # the shared form's lists of many objects


def _rows(rows: list[Any], level: int) -> str:
    if not rows or _flat(rows):
        return json.dumps(rows)
    pad = "  " * (level + 1)
    return "[\n" + ",\n".join(pad + json.dumps(row, separators=(",", ":")) for row in rows) + "\n" + "  " * level + "]"


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
