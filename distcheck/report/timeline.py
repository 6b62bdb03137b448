"""The timeline of one scenario: lanes, slices and marks, joined from the findings.

This is the model side of the Chrome trace and HTML renderers. It decides
nothing about what went wrong — that is in the findings — it only attaches each
finding to the collectives and ranks it names (by group and sequence number),
so that both renderers mark the same slices and neither does any analysis.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from distcheck.models import Event, Finding, Report, ScenarioResult

# How a slice is marked, by the finding kind that names it.
#   stuck     a waiting rank of a hang (the collective never returned)
#   odd       a rank that differs from the majority in a mismatch / order finding
#   majority  the other participants of that collective
#   crashed   the last collective of a crashed rank
MARKS = ("stuck", "odd", "majority", "crashed")


@dataclass(frozen=True)
class Slice:
    rank: int
    event: Event
    start: float                    # seconds from the timeline origin
    end: float                      # seconds; the timeline end for a call that never returned
    returned: bool
    mark: str | None = None         # one of MARKS
    finding: int | None = None      # index of the marking finding in the scenario's findings

    @property
    def name(self) -> str:
        e = self.event
        label = f" {e.label}" if e.label else ""
        return f"{e.op} #{e.seq}{label}"


@dataclass(frozen=True)
class Marker:
    """A point in time worth a flag: a rank that never came, a crash, the stall."""

    kind: str                       # absent, crash, stall, end
    t: float                        # seconds from the origin
    text: str
    rank: int | None = None         # None: the whole scenario
    finding: int | None = None


@dataclass(frozen=True)
class Lane:
    rank: int
    state: str
    note: str = ""                  # where the rank was at the end


@dataclass(frozen=True)
class ScenarioTimeline:
    result: ScenarioResult
    origin: float                   # wall-clock seconds of t = 0
    end: float                      # seconds from the origin
    lanes: tuple[Lane, ...]
    slices: tuple[Slice, ...]
    markers: tuple[Marker, ...]
    stall: tuple[float, float] | None = None   # (last progress, detection), seconds from origin


def _where(outcome) -> str:
    if outcome.exception:
        return outcome.exception
    if outcome.signal:
        return f"killed by {outcome.signal}"
    return outcome.where or outcome.phase or ""


def _marks(findings: Sequence[Finding]) -> dict[tuple[str, int, int], tuple[str, int]]:
    """(group, seq, rank) -> (mark, finding index); the first finding to name a slice wins."""
    marks: dict[tuple[str, int, int], tuple[str, int]] = {}
    for i, f in enumerate(findings):
        if f.group is None or f.seq is None:
            continue
        if f.kind == "hang":
            named = {r: "stuck" for r in f.waiting_ranks}
        elif f.kind in ("mismatch", "order"):
            # with a tie there is no majority to side with: every participant is odd
            odd = set(f.odd_ranks) if f.odd_ranks and not f.tie else {d.rank for d in f.ranks} | set(f.odd_ranks)
            named = {d.rank: ("odd" if d.rank in odd else "majority") for d in f.ranks}
            named.update({r: "odd" for r in odd})
        else:
            continue
        for rank, mark in named.items():
            marks.setdefault((f.group, f.seq, rank), (mark, i))
    return marks


def _clock(result: ScenarioResult, events: Mapping[int, Sequence[Event]]) -> tuple[float, float, float]:
    """(origin, end, pad): wall time of t = 0, the timeline's end from it, and the air on each side."""
    all_events = [e for evs in events.values() for e in evs]
    times = [e.t_enter for e in all_events] + [e.t_exit for e in all_events if e.t_exit is not None]
    first = min(times) if times else (result.started_at or 0.0)
    if result.stall_onset is not None:
        first = min(first, result.stall_onset)
    # a call that never returned lasts until the launch ended; otherwise the picture ends with the last call
    has_open = any(e.t_exit is None for e in all_events) or not all_events
    tail = (result.detected_at, result.stall_onset) + ((result.ended_at,) if has_open else ())
    last_candidates = times + [t for t in tail if t]
    last = max(last_candidates) if last_candidates else first
    # a little air on both sides, so the first and last slices are not glued to the frame
    pad = (last - first) * 0.03 or 0.005
    origin = first - pad
    return origin, last - origin + pad, pad


def _crashed(findings: Sequence[Finding]) -> dict[int, int]:
    """rank -> index of the crash finding that names it as the crashed rank."""
    crashed: dict[int, int] = {}
    for i, f in enumerate(findings):
        if f.kind == "crash":
            for d in f.ranks:
                if d.role == "crashed" or d.state == "crashed":
                    crashed.setdefault(d.rank, i)
    return crashed


def _slices(result: ScenarioResult, events: Mapping[int, Sequence[Event]], crashed: dict[int, int],
            origin: float, last_t: float) -> list[Slice]:
    marks = _marks(result.findings)
    slices: list[Slice] = []
    for rank in sorted(events):
        evs = list(events[rank])
        for j, e in enumerate(evs):
            mark = marks.get((e.group, e.seq, rank))
            if mark is None and rank in crashed and j == len(evs) - 1 and e.t_exit is None:
                mark = ("crashed", crashed[rank])
            start = e.t_enter - origin
            stop = (e.t_exit - origin) if e.t_exit is not None else last_t
            slices.append(Slice(rank=rank, event=e, start=start, end=max(stop, start), returned=e.t_exit is not None,
                                mark=mark[0] if mark else None, finding=mark[1] if mark else None))
    return slices


def _absent_markers(findings: Sequence[Finding], slices: Sequence[Slice], last_t: float) -> list[Marker]:
    markers: list[Marker] = []
    for i, f in enumerate(findings):
        if f.kind == "hang" and f.absent_ranks:
            # where the waiting ranks entered the collective the absent ones never reached
            entered = [s.start for s in slices if s.finding == i and s.mark == "stuck"]
            t = min(entered) if entered else last_t
            notes = {d.rank: d for d in f.ranks}
            for r in f.absent_ranks:
                d = notes.get(r)
                why = (d.note or d.state or d.where) if d else None
                text = f"never entered {f.op or 'the collective'} #{f.seq}" + (f" ({why})" if why else "")
                markers.append(Marker(kind="absent", t=t, text=text, rank=r, finding=i))
    return markers


def _crash_markers(result: ScenarioResult, crashed: dict[int, int], slices: Sequence[Slice],
                   last_t: float) -> list[Marker]:
    outcomes = {o.rank: o for o in result.ranks}
    markers: list[Marker] = []
    for rank, i in crashed.items():
        o = outcomes.get(rank)
        own = [s for s in slices if s.rank == rank]
        t = max((s.end if s.returned else s.start) for s in own) if own else last_t
        cause = _where(o) if o else ""
        markers.append(Marker(kind="crash", t=t, text=f"rank {rank} crashed" + (f": {cause}" if cause else ""),
                              rank=rank, finding=i))
    return markers


def _end_marker(result: ScenarioResult, origin: float) -> tuple[list[Marker], tuple[float, float] | None]:
    """How the launch ended, and the stall window (seconds from the origin) when there was one."""
    if result.stall_onset is not None and result.detected_at is not None:
        stall = (result.stall_onset - origin, result.detected_at - origin)
        what = {"stall": "stall detected", "timeout": "--timeout reached",
                "max_duration": "--max-duration reached"}.get(result.end_reason, result.end_reason)
        return [Marker(kind="stall", t=stall[1],
                       text=f"{what} after {result.detected_at - result.stall_onset:.1f} s without progress")], stall
    if result.ended_at is not None:
        return [Marker(kind="end", t=result.ended_at - origin, text=f"launch ended ({result.end_reason})")], None
    return [], None


def build(result: ScenarioResult, events: Mapping[int, Sequence[Event]]) -> ScenarioTimeline:
    """Lay one scenario's events on a common clock and attach its findings to them."""
    origin, end, pad = _clock(result, events)
    last_t = end - pad                 # where a call that never returned stops
    crashed = _crashed(result.findings)
    slices = _slices(result, events, crashed, origin, last_t)
    ending, stall = _end_marker(result, origin)
    markers = (_absent_markers(result.findings, slices, last_t) + _crash_markers(result, crashed, slices, last_t)
               + ending)
    outcomes = {o.rank: o for o in result.ranks}
    lanes = tuple(Lane(rank=r, state=outcomes[r].state if r in outcomes else "unknown",
                       note=_where(outcomes[r]) if r in outcomes else "")
                  for r in sorted(set(outcomes) | set(events)))
    return ScenarioTimeline(result=result, origin=origin, end=end, lanes=lanes, slices=tuple(slices),
                            markers=tuple(markers), stall=stall)


def build_all(report: Report, events: Mapping[str, Mapping[int, Sequence[Event]]]) -> list[ScenarioTimeline]:
    """One timeline per scenario that ran (skipped scenarios have nothing to draw)."""
    return [build(s, events.get(s.name, {})) for s in report.scenarios if not s.skipped]
