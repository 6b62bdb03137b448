"""report.json's two forms, and the one place that chooses between them.

``distcheck.report/1`` writes every value in place. A job of more than ``SHARE_ABOVE`` ranks is written in
``distcheck.report/2``, where what many ranks share is written once: at 16,384 ranks every rank's row held its
whole stack text and every finding a detail per waiting rank, 38-59 MB of report.json. In /2:

* a rank row's fields and its last call's at their default (null, false, 0, empty) are left out, but for those
  every row has (``ROW_KEEPS``, the schema's required fields);
* a scenario's distinct stack texts are listed once, in ``stacks``, each rank's thread ids cut out as
  ``{thread}``; a rank row's ``stack`` is ``{"text": i, "threads": [its ids in order]}`` (or null, or its text in
  place where the text itself holds ``{thread}``);
* a finding's run of consecutive rank details alike but for their rank is written once, ``ranks`` (runs of
  consecutive ranks, ``models.rank_runs``) in place of ``rank``.

Both keep every value: ``inline`` gives back the /1 form exactly, so one reader serves both. ``Report.as_written``
and ``Report.from_dict`` use them, with the defaults of ``results``' classes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from distcheck.models.enums import ReportSchema
from distcheck.models.runs import rank_runs, ranks_from_json

SHARE_ABOVE = 256   # a scenario of more ranks makes the report /2
ROW_KEEPS = ("rank", "host", "pid", "state", "exit_code", "signal", "collectives", "where", "stack")
THREAD = "{thread}"
_THREAD_ID = re.compile(r"(?<=[Tt]hread )0x[0-9a-fA-F]+")


Defaults = tuple[dict[str, Any], dict[str, Any]]   # a rank row's fields and a call's at their defaults, as plain values


def shared(data: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    """A report's data (long ``group_ranks`` as runs already) in the form it is written in: /2 where any
    scenario has more than ``SHARE_ABOVE`` ranks, else as it is."""
    if not any(len(s["ranks"]) > SHARE_ABOVE for s in data["scenarios"]):
        return data
    return {**data, "schema": str(ReportSchema.SHARED),
            "scenarios": [_shared_scenario(s, defaults) for s in data["scenarios"]]}


def inline(data: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    """A report's data in the /1 form, whichever form it was written in."""
    if data.get("schema") != ReportSchema.SHARED:
        return data
    return {**data, "schema": str(ReportSchema.INLINE),
            "scenarios": [_inline_scenario(s, defaults) for s in data.get("scenarios") or ()]}


def _shared_scenario(scenario: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    texts: dict[str, int] = {}
    ranks = [_without_defaults(_shared_row(row, texts), defaults) for row in scenario["ranks"]]
    findings = [{**f, "ranks": _runs_of_alike(f["ranks"])} for f in scenario["findings"]]
    return {**scenario, "ranks": ranks, "findings": findings, "stacks": list(texts)}


def _shared_row(row: dict[str, Any], texts: dict[str, int]) -> dict[str, Any]:
    stack = row.get("stack")
    if not isinstance(stack, str) or THREAD in stack:
        return row
    threads = _THREAD_ID.findall(stack)
    template = _THREAD_ID.sub(THREAD, stack)
    index = texts.setdefault(template, len(texts))
    return {**row, "stack": {"text": index, "threads": threads}}


def _without_defaults(row: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    rows, events = defaults
    out = {k: v for k, v in row.items() if k in ROW_KEEPS or k not in rows or v != rows[k]}
    if isinstance(row.get("last_event"), dict):
        out["last_event"] = {k: v for k, v in row["last_event"].items()
                             if k in EVENT_KEEPS or k not in events or v != events[k]}
    return out


def _with_defaults(row: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    rows, events = defaults
    out = {**rows, **row}
    if isinstance(row.get("last_event"), dict):
        out["last_event"] = {**events, **row["last_event"]}
    return out


EVENT_KEEPS = ("rank", "group", "seq", "op")   # a call's fields its row always has


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
        entry["ranks"] = rank_runs(entry["ranks"])
    return out


def _inline_scenario(scenario: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    texts = scenario.get("stacks") or []
    out = {k: v for k, v in scenario.items() if k != "stacks"}
    out["ranks"] = [_with_defaults(_inline_row(row, texts), defaults) for row in scenario.get("ranks") or ()]
    out["findings"] = [{**f, "ranks": _each_rank(f.get("ranks") or ())} for f in scenario.get("findings") or ()]
    return out


def _inline_row(row: dict[str, Any], texts: list[str]) -> dict[str, Any]:
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


def _each_rank(details: Any) -> list[dict[str, Any]]:
    out = []
    for entry in details:
        if "ranks" not in entry:
            out.append(entry)
            continue
        rest = {k: v for k, v in entry.items() if k != "ranks"}
        out.extend({"rank": r, **rest} for r in ranks_from_json(entry["ranks"]))
    return out
