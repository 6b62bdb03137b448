"""Wrong numbers: a distributed result that differs from its single-process
reference, and the likely reason when another finding explains it. Pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from distcheck.models import Finding, Kind, Severity
from distcheck.text import plural, rank_list, signed


def find_numeric(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    """A distributed result that differs from its single-process reference, entry by entry."""
    by_name: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for check in res.get("numeric_checks", ()):
            by_name[check["name"]][rank] = check
    findings = []
    for name, checks in by_name.items():
        bad = {r: c for r, c in checks.items() if not c["ok"]}
        if bad:
            findings.append(_numeric_finding(name, bad))
    return findings


def _numeric_finding(name: str, bad: Mapping[int, Mapping[str, Any]]) -> Finding:
    first = bad[min(bad)]
    differing = first["differing"]
    n = first.get("n_differing") or len(differing)   # older results list every entry they know
    total = math.prod(first["shape"]) if first["shape"] else 1
    if first["shape"] and differing and differing[0]["index"] is None:   # the shapes themselves differ
        what = f"its shape is {differing[0]['actual']} instead of {differing[0]['reference']}"
    else:
        shown = "; ".join(_entry(d) for d in differing[:8]) + ("; ..." if n > 8 else "")
        what = (f"{plural(n, 'entry', 'entries')} of {total} off (max |diff| {_num(first['max_abs_diff'])}): {shown}"
                if total > 1 else f"{_num(differing[0]['actual'])} instead of {_num(differing[0]['reference'])}")
    summary = f"{name!r} differs from the single-process reference on {rank_list(bad)}: {what}."
    totals = _totals(first.get("actual"), first.get("reference"))
    if totals:
        summary += f" {totals}"
    if first.get("note"):
        summary += f" {first['note']}"
    return Finding(
        kind=Kind.NUMERIC, severity=Severity.ERROR, summary=summary, odd_ranks=tuple(sorted(bad)),
        data={"check": name, "ranks": sorted(bad), "max_abs_diff": first["max_abs_diff"], "shape": first["shape"],
              "differing": differing, "actual": first.get("actual"), "reference": first.get("reference")},
    )


def _entry(d: Mapping[str, Any]) -> str:
    diff = d["actual"] - d["reference"]
    return f"{_index(d['index'])} is {_num(d['actual'])} instead of {_num(d['reference'])} ({signed(diff)})"


def _totals(actual: Any, reference: Any) -> str:
    """For a matrix: which rows' sums are off, and whether the grand total still looks right."""
    if not (isinstance(actual, list) and actual and isinstance(actual[0], list)):
        return ""
    rows_a, rows_r = [sum(row) for row in actual], [sum(row) for row in reference]
    off = [i for i, (a, r) in enumerate(zip(rows_a, rows_r)) if a != r]
    if not off:
        return ""
    rows = ", ".join(f"row {i} sums to {_num(rows_a[i])} instead of {_num(rows_r[i])}" for i in off)
    total_a, total_r = sum(rows_a), sum(rows_r)
    total = (f"the grand total {_num(total_a)} is right" if total_a == total_r
             else f"the grand total is {_num(total_a)} instead of {_num(total_r)}")
    return f"By row: {rows}; {total}."


def _index(idx: Any) -> str:
    if idx in (None, []):
        return "value"
    return "[" + ", ".join(map(str, idx)) + "]"


def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def explain_numbers(numeric: list[Finding], duplicates: Sequence[Finding],
                    crossings: Sequence[Finding] = ()) -> list[Finding]:
    """A wrong number next to duplicated/missing samples or crossed calls: name them as the likely reason."""
    reasons = []
    if duplicates:
        d = duplicates[0].data
        reasons.append(f"{d['counted']}, because {d['cause']} (see the duplicates finding)")
    if crossings:
        c = crossings[0]
        reasons.append(f"collectives of different metrics/modules were crossed from {c.op} #{c.seq} "
                       f"(group {c.group}) onwards (see the order finding)")
    if not numeric or not reasons:
        return numeric
    why = f" Likely reason: {'; and '.join(reasons)}."
    return [dataclasses.replace(f, summary=f.summary + why) for f in numeric]
