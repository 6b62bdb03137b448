"""The timeline of one scenario: lanes, slices and marks, joined from the findings.

This is the model side of the Chrome trace and HTML renderers. It decides
nothing about what went wrong — that is in the findings — it only attaches each
finding to the collectives and ranks it names (by group and sequence number),
so that both renderers mark the same slices and neither does any analysis.
Pure: no I/O.

Bounded whatever the run's length and width: a lane of more than ``FULL_CALLS``
calls keeps, in full, ``WINDOW_CALLS`` calls on each side of every call a finding
names and of its last call, and draws each stretch between them as one summary
slice ("4,980 calls: all_reduce x4,980"); a job of more than ``MAX_LANES`` ranks
draws one lane per group of ranks that behave alike (same state, same number of
calls, same last call — its op and number in a group of the same size, whichever
group of a mesh it was — same marks), and the ranks a finding names keep lanes of
their own. ``windows`` gives the time span around each finding for a close-up.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from distcheck.models import EndReason, Event, Finding, Kind, Report, ScenarioResult, is_p2p
from distcheck.report.words import EACH_RANK_UP_TO
from distcheck.text import id_list

FULL_CALLS = 400      # a lane with at most this many calls is drawn whole
WINDOW_CALLS = 12     # calls kept in full on each side of a finding's call and of a lane's last call
MAX_LANES = EACH_RANK_UP_TO   # past this many ranks, ranks that behave alike share a lane (as they share a line)
NAMED_ALONE = 8       # ranks a finding names, up to this many, get a lane each

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
    count: int = 1                  # > 1: a summary of this many calls (``event`` is the first of them)
    summary: str = ""               # what a summary slice stands for: "4,980 calls: all_reduce x4,980"

    @property
    def name(self) -> str:
        if self.count > 1:
            return self.summary
        e = self.event
        label = f" {e.label}" if e.label else ""
        return f"{e.op} #{e.seq}{label}"


class MarkerKind(str, enum.Enum):
    """What a marker flags (also its name in the Chrome trace)."""

    __str__ = str.__str__
    __format__ = str.__format__   # type: ignore[assignment]  # str's own (typeshed reads it short of self)

    ABSENT = "absent"     # a rank that never entered the call the others waited in
    CRASH = "crash"
    STALL = "stall"       # where distcheck declared the stall
    END = "end"           # where the launch ended


@dataclass(frozen=True)
class Marker:
    """A point in time worth a flag: a rank that never came, a crash, the stall."""

    kind: MarkerKind
    t: float                        # seconds from the origin
    text: str
    rank: int | None = None         # None: the whole scenario
    finding: int | None = None


@dataclass(frozen=True)
class Lane:
    rank: int
    state: str
    note: str = ""                  # where the rank was at the end
    ranks: tuple[int, ...] = ()     # the ranks this lane stands for, when it stands for a group of them

    @property
    def label(self) -> str:
        if len(self.ranks) > 1:
            return f"ranks {id_list(self.ranks, limit=4)} ({len(self.ranks)})"
        return f"rank {self.rank}"


@dataclass(frozen=True)
class ScenarioTimeline:
    result: ScenarioResult
    origin: float                   # wall-clock seconds of t = 0
    end: float                      # seconds from the origin
    lanes: tuple[Lane, ...]
    slices: tuple[Slice, ...]
    markers: tuple[Marker, ...]
    stall: tuple[float, float] | None = None   # (last progress, detection), seconds from origin
    # (start, end, what): the span around each finding (and the end) where calls are drawn in full;
    # only when some calls were summarised
    windows: tuple[tuple[float, float, str], ...] = ()
    summarised: int = 0             # calls drawn as part of a summary slice
    ranks: int = 0                  # ranks in the job (lanes may stand for groups of them)


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
        if f.kind is Kind.HANG:
            named = {r: "stuck" for r in f.waiting_ranks}
        elif f.kind in (Kind.MISMATCH, Kind.ORDER):
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
        if f.kind is Kind.CRASH:
            for d in f.ranks:
                if d.role == "crashed" or d.state == "crashed":
                    crashed.setdefault(d.rank, i)
    return crashed


def _slices(result: ScenarioResult, events: Mapping[int, Sequence[Event]], crashed: dict[int, int],
            origin: float, last_t: float) -> tuple[list[Slice], dict[str, tuple[float, float]]]:
    """Every lane's slices (long stretches between the windows summarised), and the time span of the
    window around each finding's call (by finding index, "end" for the lanes' last calls)."""
    marks = _marks(result.findings)
    slices: list[Slice] = []
    windows: dict[str, tuple[float, float]] = {}
    for rank in sorted(events):
        evs = list(events[rank])
        lane = []
        for j, e in enumerate(evs):
            mark = marks.get((e.group, e.seq, rank))
            if mark is None and rank in crashed and j == len(evs) - 1 and e.t_exit is None:
                mark = ("crashed", crashed[rank])
            start = e.t_enter - origin
            stop = (e.t_exit - origin) if e.t_exit is not None else last_t
            lane.append(Slice(rank=rank, event=e, start=start, end=max(stop, start), returned=e.t_exit is not None,
                              mark=mark[0] if mark else None, finding=mark[1] if mark else None))
        slices += lane if len(lane) <= FULL_CALLS else _summarised(lane, windows)
    return slices, windows


def _summarised(lane: list[Slice], windows: dict[str, tuple[float, float]]) -> list[Slice]:
    """The lane with only its windows in full: WINDOW_CALLS calls around each marked call and its last one."""
    anchors = {j: str(s.finding) for j, s in enumerate(lane) if s.finding is not None}
    anchors.setdefault(len(lane) - 1, "end")
    keep: set[int] = set()
    for j, what in anchors.items():
        lo, hi = max(0, j - WINDOW_CALLS), min(len(lane) - 1, j + WINDOW_CALLS)
        keep.update(range(lo, hi + 1))
        old = windows.get(what)
        span = (lane[lo].start, max(s.end for s in lane[lo:hi + 1]))
        windows[what] = span if old is None else (min(old[0], span[0]), max(old[1], span[1]))
    out: list[Slice] = []
    run: list[Slice] = []
    for j, s in enumerate(lane):
        if j in keep:
            out += [_summary(run)] if run else []
            run = []
            out.append(s)
        else:
            run.append(s)
    return out + ([_summary(run)] if run else [])


def _summary(run: list[Slice]) -> Slice:
    ops = Counter(s.event.op for s in run)
    what = ", ".join(f"{op} x{n:,}" for op, n in ops.most_common(3)) + (", ..." if len(ops) > 3 else "")
    return Slice(rank=run[0].rank, event=run[0].event, start=run[0].start, end=max(s.end for s in run),
                 returned=True, count=len(run), summary=f"{len(run):,} calls: {what}")


def _groups(result: ScenarioResult, events: Mapping[int, Sequence[Event]],
            crashed: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Representative rank -> the ranks its lane stands for: ranks in the same state, with as many calls,
    the same last call and the same marks behave alike. Every rank its own lane up to MAX_LANES ranks."""
    outcomes = {o.rank: o for o in result.ranks}
    ranks = sorted(set(outcomes) | set(events))
    if len(ranks) <= MAX_LANES:
        return {r: (r,) for r in ranks}
    marks: dict[int, list] = {}
    for (group, seq, rank), (mark, _) in _marks(result.findings).items():
        marks.setdefault(rank, []).append((group, seq, mark))
    # the few ranks a finding singles out (the one that never came, the odd one) keep lanes of their own
    named = {r for f in result.findings for few in (f.absent_ranks, f.odd_ranks) if len(few) <= NAMED_ALONE
             for r in few}
    alike: dict[tuple, list[int]] = {}
    for r in ranks:
        evs = events.get(r, ())
        last = evs[-1] if evs else None
        # the last call by its place in the step, not by its group's identity: the TP groups of a 3-D mesh each
        # have their own group and stand alike (one lane each was 10-19 MB of timeline at 512 ranks)
        key = (outcomes[r].state if r in outcomes else "unknown", len(evs),
               (len(last.group_ranks or ()), is_p2p(last.group), last.seq, last.op, last.t_exit is None)
               if last else None,
               tuple(sorted(marks.get(r, ()))), r in crashed, r if r in named else None)
        alike.setdefault(key, []).append(r)
    return {members[0]: tuple(members) for members in alike.values()}


def _absent_markers(findings: Sequence[Finding], slices: Sequence[Slice], last_t: float) -> list[Marker]:
    markers: list[Marker] = []
    for i, f in enumerate(findings):
        if f.kind is Kind.HANG and f.absent_ranks:
            # where the waiting ranks entered the collective the absent ones never reached
            entered = [s.start for s in slices if s.finding == i and s.mark == "stuck"]
            t = min(entered) if entered else last_t
            notes = {d.rank: d for d in f.ranks}
            for r in f.absent_ranks:
                d = notes.get(r)
                why = (d.note or d.state or d.where) if d else None
                text = f"never entered {f.op or 'the collective'} #{f.seq}" + (f" ({why})" if why else "")
                markers.append(Marker(kind=MarkerKind.ABSENT, t=t, text=text, rank=r, finding=i))
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
        markers.append(Marker(kind=MarkerKind.CRASH, t=t, text=f"rank {rank} crashed" + (f": {cause}" if cause else ""),
                              rank=rank, finding=i))
    return markers


def _end_marker(result: ScenarioResult, origin: float) -> tuple[list[Marker], tuple[float, float] | None]:
    """How the launch ended, and the stall window (seconds from the origin) when there was one."""
    if result.stall_onset is not None and result.detected_at is not None:
        stall = (result.stall_onset - origin, result.detected_at - origin)
        what = EndReason.of(result.end_reason).words   # as every view says it
        return [Marker(kind=MarkerKind.STALL, t=stall[1],
                       text=f"{what} after {result.detected_at - result.stall_onset:.1f} s without progress")], stall
    if result.ended_at is not None:
        return [Marker(kind=MarkerKind.END, t=result.ended_at - origin,
                       text=f"launch ended ({EndReason.of(result.end_reason).words})")], None
    return [], None


def build(result: ScenarioResult, events: Mapping[int, Sequence[Event]]) -> ScenarioTimeline:
    """Lay one scenario's events on a common clock and attach its findings to them."""
    origin, end, pad = _clock(result, events)
    last_t = end - pad                 # where a call that never returned stops
    crashed = _crashed(result.findings)
    groups = _groups(result, events, crashed)
    shown = {r: events[r] for r in groups if r in events}
    slices, spans = _slices(result, shown, crashed, origin, last_t)
    ending, stall = _end_marker(result, origin)
    markers = (_absent_markers(result.findings, slices, last_t) + _crash_markers(result, crashed, slices, last_t)
               + ending)
    outcomes = {o.rank: o for o in result.ranks}
    lanes = tuple(Lane(rank=r, state=outcomes[r].state if r in outcomes else "unknown",
                       note=_where(outcomes[r]) if r in outcomes else "", ranks=groups[r] if len(groups[r]) > 1 else ())
                  for r in sorted(groups))
    summarised = sum(s.count for s in slices if s.count > 1)
    windows = tuple((t0, t1, _window_title(result, what)) for what, (t0, t1) in sorted(spans.items())) \
        if summarised else ()
    return ScenarioTimeline(result=result, origin=origin, end=end, lanes=lanes, slices=tuple(slices),
                            markers=tuple(markers), stall=stall, windows=windows, summarised=summarised,
                            ranks=len(set(outcomes) | set(events)))


def _window_title(result: ScenarioResult, what: str) -> str:
    if what == "end":
        return "the last calls"
    f = result.findings[int(what)]
    return f"around {f.kind} at {f.op or 'the call'} #{f.seq}"


def zoom(tl: ScenarioTimeline, start: float, end: float) -> ScenarioTimeline:
    """The part of ``tl`` between ``start`` and ``end`` (seconds from its origin), as a timeline of its own."""
    pad = (end - start) * 0.03 or 0.005
    t0, t1 = start - pad, end + pad
    slices = tuple(replace(s, start=max(s.start, t0) - t0, end=min(s.end, t1) - t0)
                   for s in tl.slices if s.end >= t0 and s.start <= t1)
    markers = tuple(replace(m, t=m.t - t0) for m in tl.markers if t0 <= m.t <= t1)
    stall = (max(tl.stall[0], t0) - t0, min(tl.stall[1], t1) - t0) if tl.stall and tl.stall[1] >= t0 \
        and tl.stall[0] <= t1 else None
    return replace(tl, origin=tl.origin + t0, end=t1 - t0, slices=slices, markers=markers, stall=stall, windows=())


def build_all(report: Report, events: Mapping[str, Mapping[int, Sequence[Event]]]) -> list[ScenarioTimeline]:
    """One timeline per scenario that ran (skipped scenarios have nothing to draw)."""
    return [build(s, events.get(s.name, {})) for s in report.scenarios if not s.skipped]
