"""report.json's two forms, and the one place that chooses between them.

``distcheck.report/1`` writes every value in place. A job of more than ``SHARE_ABOVE`` ranks is written in
``distcheck.report/2``, where what many ranks share is written once: at 16,384 ranks every rank's row held its
whole stack text, its last call whole and every finding a detail per waiting rank, 38-59 MB of report.json. In /2:

* a scenario's ``row_defaults`` holds each plain field's most common value over its rank rows; a row leaves out
  the fields that have it (``rank`` is always written);
* a last call's own fields (``CALL_OWN``: its rank, group, number, times, error) stay in the row, the rest
  (op, shapes, dtypes, members, call site...), which the ranks of a group waiting in one call share, is listed once
  in the scenario's ``calls``, and the row's ``last_event`` names it: ``"call": i``; in both, null values are left
  out (a call's fields read back as null where absent);
* a scenario's distinct stack texts are listed once, in ``stacks``, each rank's thread ids cut out as
  ``{thread}``; a rank row's ``stack`` is ``{"text": i, "threads": [its ids in order]}`` (or null, or its text in
  place where the text itself holds ``{thread}``);
* a finding's run of consecutive rank details alike but for their rank is written once, ``ranks`` (runs of
  consecutive ranks, ``models.rank_runs``, or the ranks where that is shorter) in place of ``rank``.

``inline`` gives the /1 form back (a last call's null fields apart, which its reader takes as null), so one reader,
``Report.from_dict``, serves both; ``Report.as_written`` writes through ``shared``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from distcheck.models.enums import ReportSchema
from distcheck.models.runs import ranks_from_json, shorter_form

SHARE_ABOVE = 256   # a scenario of more ranks makes the report /2
CALL_OWN = ("rank", "group", "seq", "t_enter", "t_exit", "t_returned", "error")   # a last call's, in its row
THREAD = "{thread}"
_THREAD_ID = re.compile(r"(?<=[Tt]hread )0x[0-9a-fA-F]+")
_PLAIN = (str, int, float, bool, type(None))


def shared(data: dict[str, Any]) -> dict[str, Any]:
    """A report's data (long ``group_ranks`` as runs already) in the form it is written in: /2 where any
    scenario has more than ``SHARE_ABOVE`` ranks, else as it is."""
    if not any(len(s["ranks"]) > SHARE_ABOVE for s in data["scenarios"]):
        return data
    return {**data, "schema": str(ReportSchema.SHARED), "scenarios": [_shared_scenario(s) for s in data["scenarios"]]}


def inline(data: dict[str, Any]) -> dict[str, Any]:
    """A report's data in the /1 form, whichever form it was written in."""
    if data.get("schema") != ReportSchema.SHARED:
        return data
    return {**data, "schema": str(ReportSchema.INLINE),
            "scenarios": [_inline_scenario(s) for s in data.get("scenarios") or ()]}


def _shared_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    texts: dict[str, int] = {}
    calls: dict[str, tuple[int, dict[str, Any]]] = {}
    rows = [_shared_call(_shared_stack(row, texts), calls) for row in scenario["ranks"]]
    defaults = _most_common(rows)
    rows = [{k: v for k, v in row.items() if k == "rank" or not _is_default(k, v, defaults)} for row in rows]
    findings = [{**f, "ranks": _runs_of_alike(f["ranks"])} for f in scenario["findings"]]
    return {**scenario, "ranks": rows, "findings": findings, "row_defaults": defaults, "stacks": list(texts),
            "calls": [call for _, call in calls.values()]}


def _most_common(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, Counter] = {}
    for row in rows:
        for k, v in row.items():
            if k != "rank" and isinstance(v, _PLAIN):
                counts.setdefault(k, Counter())[(type(v), v)] += 1
    return {k: c.most_common(1)[0][0][1] for k, c in counts.items()}


def _is_default(key: str, value: Any, defaults: dict[str, Any]) -> bool:
    if key not in defaults or not isinstance(value, _PLAIN):
        return False
    default = defaults[key]
    return type(value) is type(default) and value == default   # True is not 1, 0.0 is not 0


def _shared_stack(row: dict[str, Any], texts: dict[str, int]) -> dict[str, Any]:
    stack = row.get("stack")
    if not isinstance(stack, str) or THREAD in stack:
        return row
    threads = _THREAD_ID.findall(stack)
    template = _THREAD_ID.sub(THREAD, stack)
    index = texts.setdefault(template, len(texts))
    return {**row, "stack": {"text": index, "threads": threads}}


def _shared_call(row: dict[str, Any], calls: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    event = row.get("last_event")
    if not isinstance(event, dict):
        return row
    own = {k: v for k, v in event.items() if k in CALL_OWN and v is not None}
    call = {k: v for k, v in event.items() if k not in CALL_OWN and v is not None}
    key = json.dumps(call, sort_keys=True, default=str)
    index = calls.setdefault(key, (len(calls), call))[0]
    return {**row, "last_event": {**own, "call": index}}


def _runs_of_alike(details: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive details alike but for their rank, as one: their order is kept, so ``inline`` restores it."""
    out: list[dict[str, Any]] = []
    last_key = None
    for detail in details:
        rest = {k: v for k, v in detail.items() if k != "rank"}
        key = json.dumps(rest, sort_keys=True, default=str)
        if out and key == last_key:
            out[-1]["ranks"].append(detail["rank"])
        else:
            out.append({"ranks": [detail["rank"]], **rest})
            last_key = key
    for entry in out:
        entry["ranks"] = shorter_form(entry["ranks"])
    return out


def _inline_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    texts, calls = scenario.get("stacks") or [], scenario.get("calls") or []
    defaults = scenario.get("row_defaults") or {}
    out = {k: v for k, v in scenario.items() if k not in ("stacks", "calls", "row_defaults")}
    out["ranks"] = [_inline_call(_inline_stack({**defaults, **row}, texts), calls)
                    for row in scenario.get("ranks") or ()]
    out["findings"] = [{**f, "ranks": _each_rank(f.get("ranks") or ())} for f in scenario.get("findings") or ()]
    return out


def _inline_stack(row: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    stack = row.get("stack")
    if not isinstance(stack, dict):
        return row
    parts = texts[stack["text"]].split(THREAD)
    threads = stack["threads"]
    if len(threads) != len(parts) - 1:
        raise ValueError(f"rank {row.get('rank')}'s stack names {len(threads)} threads where its text has "
                         f"{len(parts) - 1}")
    text = parts[0] + "".join(t + p for t, p in zip(threads, parts[1:]))
    return {**row, "stack": text}


def _inline_call(row: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    event = row.get("last_event")
    if not isinstance(event, dict) or "call" not in event:
        return row
    own = {k: v for k, v in event.items() if k != "call"}
    return {**row, "last_event": {**calls[event["call"]], **own}}


def _each_rank(details: Any) -> list[dict[str, Any]]:
    out = []
    for entry in details:
        if "ranks" not in entry:
            out.append(entry)
            continue
        rest = {k: v for k, v in entry.items() if k != "ranks"}
        out.extend({"rank": r, **rest} for r in ranks_from_json(entry["ranks"]))
    return out
