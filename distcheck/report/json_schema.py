"""JSON Schema (draft 2020-12) of ``report.json``: ``distcheck.report/1`` (``REPORT_INLINE``), and /2
(``REPORT_SHARED``: a job of many ranks, what its ranks share written once, ``models.report_form``); ``REPORT``
takes either.

It pins the fields later tools and CI rely on (issue 2's JSON contract);
reports may carry more. Tests validate every JSON report against it.
"""

from __future__ import annotations

from typing import Any

from distcheck.models import FINDING_KINDS, RANK_STATES, SEVERITIES, EndReason, ReportSchema

_INT_OR_NULL = {"type": ["integer", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
_RANKS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

RANK: dict[str, Any] = {
    "type": "object",
    "required": ["rank", "host", "pid", "state", "exit_code", "signal", "collectives", "where", "stack"],
    "properties": {
        "rank": {"type": "integer", "minimum": 0}, "host": {"type": "string"}, "pid": _INT_OR_NULL,
        "state": {"enum": list(RANK_STATES)}, "exit_code": _INT_OR_NULL, "signal": _STR_OR_NULL,
        "collectives": {"type": "integer", "minimum": 0}, "where": _STR_OR_NULL, "stack": _STR_OR_NULL,
        "rss_bytes": _INT_OR_NULL, "peak_rss_bytes": _INT_OR_NULL,
    },
}

FINDING = {
    "type": "object",
    "required": ["kind", "severity", "group", "seq", "op", "label", "callsite", "summary",
                 "waiting_ranks", "absent_ranks", "detected_after_s"],
    "properties": {
        "kind": {"enum": [k.value for k in FINDING_KINDS]}, "severity": {"enum": [s.value for s in SEVERITIES]},
        "group": _STR_OR_NULL, "seq": _INT_OR_NULL, "op": _STR_OR_NULL, "label": _STR_OR_NULL,
        "callsite": _STR_OR_NULL, "summary": {"type": "string", "minLength": 1},
        "waiting_ranks": _RANKS, "absent_ranks": _RANKS, "detected_after_s": {"type": ["number", "null"]},
    },
}

_PLACEMENT = {
    "type": ["object", "null"],   # null: torch has no such call (all_reduce out of place, all_to_all in place)
    "required": ["time_us", "algbw", "busbw", "wrong"],
    "properties": {"time_us": {"type": "number", "minimum": 0}, "algbw": {"type": "number", "minimum": 0},
                   "busbw": {"type": "number", "minimum": 0}, "wrong": _INT_OR_NULL},
}
TABLE = {   # a table a scenario reported; comm_health's carry their results as named ``records`` too
    "type": "object",
    "required": ["title", "columns", "rows"],
    "properties": {
        "title": {"type": "string"}, "columns": {"type": "array", "items": {"type": "string"}},
        "rows": {"type": "array", "items": {"type": "array"}},
        "records": {"type": "array", "items": {"type": "object", "properties": {
            "out_of_place": _PLACEMENT, "in_place": _PLACEMENT}}},
    },
}

_END_REASON = {"enum": [str(e) for e in EndReason]}   # docs/endings.md names each

SCENARIO: dict[str, Any] = {
    "type": "object",
    "required": ["name", "source", "expected", "observed", "ok", "duration_s", "ranks", "findings"],
    "properties": {
        "name": {"type": "string"}, "source": {"type": "string"},
        "expected": {"type": "array", "items": {"type": "string"}},
        "observed": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"}, "duration_s": {"type": "number", "minimum": 0},
        "ranks": {"type": "array", "items": RANK}, "findings": {"type": "array", "items": FINDING},
        "tables": {"type": "array", "items": TABLE},
        "end_reason": _END_REASON,
        "command_exit": {"type": ["integer", "null"]},
    },
}

# /2: a row holds its rank and what differs from the scenario's ``row_defaults``; its stack is the index of its
# text in ``stacks`` and its thread ids, its last call its own fields and the index of the rest in ``calls``
SHARED_RANK: dict[str, Any] = {
    "type": "object",
    "required": ["rank"],
    "properties": {
        **{k: v for k, v in RANK["properties"].items() if k != "stack"},
        "stack": {"oneOf": [_STR_OR_NULL, {
            "type": "object", "required": ["text", "threads"],
            "properties": {"text": {"type": "integer", "minimum": 0},
                           "threads": {"type": "array", "items": {"type": "string"}}}}]},
        "last_event": {"type": ["object", "null"], "required": ["rank", "group", "seq", "call"],
                       "properties": {"call": {"type": "integer", "minimum": 0}}},
    },
}
SHARED_SCENARIO = {
    **SCENARIO,
    "required": [*SCENARIO["required"], "row_defaults", "stacks", "calls"],
    "properties": {
        **SCENARIO["properties"], "ranks": {"type": "array", "items": SHARED_RANK},
        "row_defaults": {"type": "object"}, "stacks": {"type": "array", "items": {"type": "string"}},
        "calls": {"type": "array", "items": {"type": "object", "required": ["op"]}},
    },
}


def _report(schema: ReportSchema, scenario: dict) -> dict:
    return {
        "type": "object",
        "required": ["schema", "verdict", "run", "scenarios"],
        "properties": {
            "schema": {"const": str(schema)},
            "verdict": {"enum": ["pass", "fail"]},
            "end_reason": _END_REASON,
            "run": RUN,
            "scenarios": {"type": "array", "items": scenario},
        },
    }


RUN = {
    "type": "object",
    "required": ["backend", "world_size", "nnodes", "torch_version", "distcheck_version", "command",
                 "run_dir", "seed", "duration_s"],
    "properties": {
        "backend": {"type": "string"}, "world_size": {"type": "integer", "minimum": 1},
        "nnodes": {"type": "integer", "minimum": 1}, "torch_version": {"type": "string"},
        "distcheck_version": {"type": "string"}, "command": {"type": "string"},
        "run_dir": {"type": "string"}, "seed": {"type": "integer"},
        "duration_s": {"type": "number", "minimum": 0},
        "torch_features": {"type": "object", "additionalProperties": {"type": "boolean"}},
    },
}
REPORT_INLINE = _report(ReportSchema.INLINE, SCENARIO)
REPORT_SHARED = _report(ReportSchema.SHARED, SHARED_SCENARIO)
REPORT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "distcheck report",
    "oneOf": [REPORT_INLINE, REPORT_SHARED],
}
