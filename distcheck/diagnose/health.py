"""Health requirements a scenario declared (``ctx.require``) → ``health`` findings. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from distcheck.models import Finding, Kind, Severity
from distcheck.text import rank_list


def health_findings(results: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    failed: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, res in sorted(results.items()):
        for req in res.get("requirements", ()):
            if not req["ok"]:
                failed[req["name"]][rank] = req
    findings = []
    for name, by_rank in failed.items():
        first = by_rank[min(by_rank)]
        findings.append(Finding(
            kind=Kind.HEALTH, severity=Severity(first.get("severity", Severity.ERROR)),
            odd_ranks=tuple(sorted(by_rank)),
            summary=f"{first['summary']} (reported by {rank_list(by_rank)})",
            data={"requirement": name, **first.get("data", {})},
        ))
    return findings


def first_tables(results: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The lowest rank's tables: every rank measures the same collectives."""
    for _, res in sorted(results.items()):
        if res.get("tables"):
            return tuple(res["tables"])
    return ()
