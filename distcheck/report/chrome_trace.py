"""Chrome trace-event JSON (Perfetto, chrome://tracing): one lane per rank.

Each scenario is a process (``pid``), each rank a thread (``tid``) in it, each
collective a complete slice (``ph: X``) named ``op #seq label``, with the
fingerprint and call site as args. Slices the findings name carry the category
``distcheck.<mark>`` and a warning colour; ranks that never came, crashes and the
stall detection are instant events. A long run's stretches between the windows
around its findings are one summary slice each, and a wide job's alike ranks
share a thread (``distcheck.report.timeline``). Layout only: which slice is stuck or odd
comes from the findings, joined in ``distcheck.report.timeline``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from distcheck.models import Event, Report
from distcheck.report.words import verdict
from distcheck.report.timeline import ScenarioTimeline, build_all

# chrome://tracing's reserved colour names (Perfetto picks its own colours by name)
COLOURS = {"stuck": "terrible", "odd": "terrible", "majority": "bad", "crashed": "terrible",
           "absent": "bad", "crash": "terrible", "stall": "black", "end": "grey"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _slice_args(tl: ScenarioTimeline, s) -> dict[str, Any]:
    e: Event = s.event
    if s.count > 1:   # a stretch of calls summarised (``report.timeline``): the windows around it are in full
        return {"calls": s.count, "first_seq": e.seq}
    args: dict[str, Any] = {
        "fingerprint": e.fingerprint(), "seq": e.seq, "label": e.label, "callsite": e.callsite,
        "library_callsite": e.library_callsite, "async": e.async_op, "returned": s.returned,
    }
    if e.error:
        args["error"] = e.error
    if s.finding is not None:
        f = tl.result.findings[s.finding]
        args["finding"] = {"kind": f.kind, "mark": s.mark, "summary": f.summary}
    return args


def _scenario_events(pid: int, tl: ScenarioTimeline, base: float) -> list[dict[str, Any]]:
    r = tl.result
    shift = tl.origin - base
    title = verdict(r) if r.script else f"{r.name}: {verdict(r)}"   # a script as a script (report.words)
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": title}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}},
    ]
    for lane in tl.lanes:
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane.rank, "ts": 0,
                    "args": {"name": f"{lane.label} ({lane.state})"}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": lane.rank, "ts": 0,
                    "args": {"sort_index": lane.rank}})
    for s in tl.slices:
        name = s.name if s.returned else f"{s.name} (never returned)"
        ev: dict[str, Any] = {
            "ph": "X", "name": name, "cat": f"distcheck.{s.mark}" if s.mark else
            "summary" if s.count > 1 else ("p2p" if s.event.is_p2p else "collective"),
            "pid": pid, "tid": s.rank, "ts": _us(shift + s.start), "dur": _us(s.end - s.start),
            "args": _slice_args(tl, s),
        }
        if s.mark:
            ev["cname"] = COLOURS[s.mark]
        out.append(ev)
    for m in tl.markers:
        ev = {"ph": "i", "name": m.text, "cat": f"distcheck.{m.kind}", "pid": pid,
              "tid": m.rank if m.rank is not None else (tl.lanes[0].rank if tl.lanes else 0),
              "ts": _us(shift + m.t), "s": "t" if m.rank is not None else "p", "cname": COLOURS.get(m.kind, "grey"),
              "args": {"kind": m.kind}}
        if m.finding is not None:
            ev["args"]["finding"] = tl.result.findings[m.finding].summary
        out.append(ev)
    return out


def render(report: Report, events: Mapping[str, Mapping[int, Sequence[Event]]]) -> str:
    """The whole report as one trace; scenarios keep their real order in time."""
    timelines = build_all(report, events)
    base = min((tl.origin for tl in timelines), default=0.0)
    trace_events: list[dict[str, Any]] = []
    for pid, tl in enumerate(timelines, start=1):
        trace_events.extend(_scenario_events(pid, tl, base))
    doc = {
        "traceEvents": trace_events,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": f"distcheck {report.run.distcheck_version}", "verdict": report.verdict,
            "backend": report.run.backend, "world_size": report.run.world_size, "seed": report.run.seed,
            "torch": report.run.torch_version, "run_dir": report.run.run_dir, "started_at": report.run.started_at,
        },
    }
    return json.dumps(doc, separators=(",", ":")) + "\n"   # compact: indentation grows with every slice
