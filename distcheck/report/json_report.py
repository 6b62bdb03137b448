"""JSON renderer: the versioned report schema (``distcheck.report/1``)."""

from __future__ import annotations

import json

from distcheck.models import Report


def render(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"
