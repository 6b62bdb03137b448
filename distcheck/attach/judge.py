"""From what attach read of each rank to the run path's own verdict: the positions become the records
the rules take (an open ``Event`` per rank waiting in a collective, a ``RankOutcome`` per rank), the
wait-for graph (``diagnose.waitfor``) says when the hang is certain, the one definition of progress
(``diagnose.progress``, over ``launch.procs.ActivityMeter``'s counters and the samples' stacks) tells a
late rank from a stuck one, and ``diagnose.verdict`` gives the findings. Pure.

Read from outside there are no sequence numbers: every rank waiting in a collective is taken to wait
in the call open now on the default group (``#1``), which the report words drop (``attach_words``). A rank whose
host is blocked in a device sync (``attach.device``) waits in the first call its Flight Recorder dump holds not
completed; without a dump that says which, nothing is decided."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distcheck.attach import device
from distcheck.attach.flight import FrCall, FrState, members, open_call
from distcheck.attach.position import Position, Where
from distcheck.attach.read import ProcState
from distcheck.diagnose.apart import call_words, calls_apart
from distcheck.diagnose.common import RunFacts
from distcheck.diagnose.progress import IO_FLOOR_BPS, Signs, progress as progress_in
from distcheck.diagnose.verdict import Evidence, Scenario, scenario_result
from distcheck.diagnose.waitfor import certain_hang
from distcheck.launch.procs import Activity
from distcheck.launch.progress import RankProgress
from distcheck.models import (EndReason, Event, Finding, GroupKey, Kind, Phase, RankDetail, RankOutcome, RankState,
                              ScenarioResult, Severity)
from distcheck.text import rank_list, site, size

GROUP, SEQ = GroupKey("0"), 1          # the call open now, on the default group: what attach can tell from outside
# A rank blocked in one collective sleeps in the backend's wait: its main thread does not wake. One that
# wakes while seen in "the same" call is completing calls one after another (a healthy loop).
MAX_WAKEUPS_WAITING = 2


@dataclass(frozen=True)
class RankView:
    """Everything attach saw of one rank: a position per sample, its counters between the first and the
    last sample, and /proc's state at the end."""

    rank: int
    pid: int
    positions: tuple[Position, ...]
    activity: Activity | None
    state: ProcState
    host: str = ""
    node: int = 0
    fr: FrState | None = None          # its Flight Recorder dump, where the job left one


@dataclass(frozen=True)
class Judged:
    result: ScenarioResult
    events: dict[int, list[Event]]
    undecided: str | None = None       # the "not decided" finding's summary: ranks were not read and nothing else
    #                                    was found (attach exits 3, never passes); None once the verdict is decided


def waiting_in(view: RankView) -> Position | None:
    """The collective the rank waits in: the same one, at the same stack, in every sample, without waking.
    A native wait is read only in the last sample (it pauses the rank): the Python stack of the others,
    the same, stands for it."""
    seen = readable(view)
    last = seen[-1] if seen else None
    if not view.state.alive or last is None or len(seen) < 2 or last.kind != Where.COLLECTIVE:
        return None
    if any(p.digest != last.digest or (p.op != last.op and last.native_wait is None) for p in seen):
        return None
    if view.activity is not None and view.activity.wakeups > MAX_WAKEUPS_WAITING:
        return None
    return last


def readable(view: RankView) -> list[Position]:
    """The samples py-spy could read: on a loaded node one read of 32 may time out, and an unreadable sample
    is no evidence that the rank moved (it made rank 0 of a 32-rank hang look like it had left its call)."""
    return [p for p in view.positions if p.kind != Where.UNREADABLE]


def progress(view: RankView) -> str | None:
    """The evidence that a rank outside the collectives makes progress (``diagnose.progress``, judged once:
    wake-ups alone are none), in the watchdog's words; None when it shows none. Under load a sample finds a
    polling loop on its other line now and then (one of 32 polling ranks read as late, and the hang was
    missed), so a move counts only from one function to another."""
    act = view.activity
    seen = readable(view)
    signs = dataclasses.replace(act.signs() if act else Signs(), stack_moved=len({p.calls for p in seen}) > 1,
                                running=(sum(p.active for p in seen), len(seen)),
                                # A device sync may spin (CUDA's default on an idle core): its CPU is the wait.
                                spinning=device.synced(view.positions, view.state.alive) is not None)
    return progress_in(signs, keeps_watching=False)


def _event(view: RankView, at: Position, world: tuple[int, ...], t: float) -> Event:
    return Event(rank=view.rank, group=GROUP, seq=SEQ, op=at.op or "collective", t_enter=t, callsite=at.callsite,
                 library_callsite=at.library_callsite, label=at.label, group_ranks=world,
                 native=at.native_wait is not None)


def _outcome(view: RankView, at: Position | None, event: Event | None, stuck: bool, late: str | None) -> RankOutcome:
    last = (readable(view) or list(view.positions) or [Position(Where.UNREADABLE)])[-1]
    common: dict[str, Any] = dict(rank=view.rank, host=view.host, node=view.node, pid=view.pid,
                                  stack=last.stack or None, phase=Phase.RUNNING)
    if not view.state.alive:
        return RankOutcome(state=RankState.CRASHED, exception="gone: its process had exited when attach read it",
                           **common)
    if event is not None:   # a call not completed on the device: the host's line is where the rank is
        return RankOutcome(state=RankState.STUCK if stuck else RankState.RUNNING, last_event=event,
                           where=last.callsite if event.enqueued else event.callsite, collectives=1,
                           flight_recorder=_status(view), **common)
    where = last.callsite or (f"in the kernel at {view.state.wchan}" if view.state.wchan else None)
    blocked = not late and device.synced(view.positions, True) is not None   # its host waits for the device
    return RankOutcome(state=RankState.STUCK if blocked else RankState.RUNNING, where=where,
                       busy_at=where if late else None, flight_recorder=_status(view), **common)


def _status(view: RankView) -> dict[str, dict[str, int]] | None:
    """NCCL's pg_status from the rank's dump (how far each group was enqueued and completed on the device)."""
    return {g: dict(s) for g, s in view.fr.status.items()} if view.fr is not None and view.fr.status else None


def _progress_of(view: RankView, event: Event | None, world: tuple[int, ...], joined: bool) -> RankProgress:
    """What the wait-for graph reads of a rank: waiting in the open call, or running (it may yet come); with
    the Flight Recorder joined, how far it went in each group."""
    group_ranks = (event.group_ranks or world) if event else ()
    # Stacks alone hold no fingerprint: ranks at other ops may be in other groups' calls, never "cannot match".
    signature = f"{event.op} {group_ranks}" if event and joined else "a collective"
    waits = ((event.group, event.seq, group_ranks, signature),) if event else ()
    entered = dict(view.fr.entered) if joined and view.fr else {}
    if event:
        entered[event.group] = max(entered.get(event.group, 0), event.seq)
    return RankProgress(phase=Phase.RUNNING, alive=view.state.alive, open_collectives=len(waits), waits=waits,
                        entered=entered, settled=True)


def _end(views: Mapping[int, RankView], events: Mapping[int, Event], late: Mapping[int, str], world_size: int
         ) -> tuple[EndReason, str | None]:
    """How the job stands, and the evidence the verdict rests on. A rank nobody read (another node's, one whose
    attach never came) may be anywhere: while one is awaited, nothing is decided."""
    if not events:
        return EndReason.COMPLETED, None
    world = tuple(range(max(world_size, max(views) + 1)))
    joined = fr_joined(views)
    certain = certain_hang({r: _progress_of(v, events.get(r), world, joined) for r, v in views.items()})
    if certain is not None:
        return EndReason.CERTAIN_HANG, certain.evidence
    if unread(views, world_size) or unreadable(views):
        return EndReason.COMPLETED, None
    absent = [r for r in views if r not in events]
    if any(r in late for r in absent):
        return EndReason.COMPLETED, None
    samples = len(next(iter(views.values())).positions)
    if not absent:
        one = calls_apart(events) is None or joined
        return EndReason.STALL, f"every rank in {'it' if one else 'a collective'}, none out of it in {samples} samples"
    # The rules say where an absent rank is in the table's word for it ("running outside any collective"): the
    # evidence says what it did there, in no other word for its state.
    blocked = _synced({r: views[r] for r in absent})
    cpu = f"no CPU outside the device sync of {rank_list(sorted(blocked))}" if blocked else "no CPU"
    each = "each " if len(events) > 1 else ""
    return EndReason.STALL, (f"certain from outside: {rank_list(absent)} made no progress outside every collective "
                             f"({cpu}, no I/O beyond {size(IO_FLOOR_BPS)}/s, in the same functions in {samples} "
                             f"samples); {rank_list(sorted(events))} {each}in the same call in every sample"
                             f"{_fr_words(views, events)}")


def _synced(views: Mapping[int, RankView]) -> dict[int, Position]:
    """The ranks whose host is blocked in a device sync, and where."""
    return {r: at for r, v in views.items() if (at := device.synced(v.positions, v.state.alive)) is not None}


def _fr_words(views: Mapping[int, RankView], events: Mapping[int, Event]) -> str:
    """Which evidence the verdict rests on besides the stacks: the Flight Recorder, joined by sequence number."""
    if not fr_joined(views):
        blocked = _synced(views)
        return (" (stacks and /proc only: no Flight Recorder dump to join" +
                (f"; which call {rank_list(sorted(blocked))} waits in on the device is not known: {device.FR_TODO})"
                 if blocked else ")"))
    ref = events[min(events)]
    behind = sorted(r for r, v in views.items() if v.fr and v.fr.entered.get(ref.group, 0) < ref.seq)
    return (f"; the Flight Recorder dumps of every rank, joined by sequence number: {ref.op} #{ref.seq} "
            f"[group {ref.group}] in flight on {rank_list(sorted(events))}"
            + (f", never entered by {rank_list(behind)}" if behind else ""))


def fr_joined(views: Mapping[int, RankView]) -> bool:
    """Whether the Flight Recorder is joined: every rank read has a dump, and every rank whose stack waits in a
    collective, or whose host is blocked in a device sync, has a call in flight in it (else the dumps are older
    than the hang)."""
    states = {r: v.fr for r, v in views.items() if v.fr is not None}
    if not views or len(states) != len(views):
        return False
    return all(open_call(r, states) is not None for r, v in views.items()
               if waiting_in(v) is not None or device.synced(v.positions, v.state.alive) is not None)


def _events(views: Mapping[int, RankView], world_size: int, started: float) -> dict[int, Event]:
    """The call each waiting rank is in: from its stack (the default group's open call), or, with the Flight
    Recorder joined, the call in flight in its dump (its group and number), also for a rank whose Python thread
    is past it (an async op's ``wait()``, NCCL's kernels) and sits idle."""
    joined = fr_joined(views)
    states = {r: v.fr for r, v in views.items() if v.fr is not None} if joined else {}
    out = {}
    world = tuple(range(world_size))   # one tuple for every rank's event: at 4,096 ranks, 4,096 copies cost 1 s
    for r, v in views.items():
        at = waiting_in(v)
        call = open_call(r, states) if joined else None
        if call is not None and (at is not None or (v.state.alive and progress(v) is None)):
            out[r] = _fr_event(v, at, call, members(call.group, states, world_size), started)
        elif at is not None and not joined:
            out[r] = _event(v, at, world, started)
    return out


def _compared(views: Mapping[int, RankView], events: Mapping[int, Event]) -> dict[int, list[Event]]:
    out = {r: [e] for r, e in events.items()}
    if not events or not fr_joined(views):
        return out
    group = events[min(events)].group
    for r, v in views.items():
        call = v.fr.last.get(group) if v.fr else None
        if r not in events and call is not None:
            ranks = events[min(events)].group_ranks
            out[r] = [Event(rank=r, group=group, seq=call.seq, op=call.op, t_enter=0.0, t_exit=0.0, shapes=call.shapes,
                            dtypes=call.dtypes, callsite=call.callsite, group_ranks=ranks, native=True)]
    return out


def _fr_event(view: RankView, at: Position | None, call: FrCall, group_ranks: tuple[int, ...], t: float) -> Event:
    """The call in flight in the rank's dump, as the rules take it. Its host past it (blocked in a device sync, or
    anywhere on NCCL, whose dump says the call is not completed on the device): the call returned and its work did
    not complete, called where the dump says (the host's line is the rank's whereabouts, not the call's)."""
    last = (readable(view) or [Position(Where.UNREADABLE)])[-1]
    op = at.op if at is not None and at.op not in (None, "collective") else call.op
    on_device = view.fr is not None and view.fr.device
    if at is None and (on_device or device.synced(view.positions, view.state.alive) is not None):
        return Event(rank=view.rank, group=GroupKey(call.group), seq=call.seq, op=op, t_enter=t, t_returned=t,
                     shapes=call.shapes, dtypes=call.dtypes, callsite=call.callsite, group_ranks=group_ranks,
                     native=True)
    return Event(rank=view.rank, group=GroupKey(call.group), seq=call.seq, op=op, t_enter=t, shapes=call.shapes,
                 dtypes=call.dtypes, callsite=(at or last).callsite or call.callsite,
                 library_callsite=at.library_callsite if at else None, label=at.label if at else None,
                 group_ranks=group_ranks, native=at is None or at.native_wait is not None)


def late_finding(events: Mapping[int, Event], late: Mapping[int, str], views: Mapping[int, RankView]) -> Finding:
    """Ranks wait in a call while the others make progress outside: late, not hung (as the watchdog keeps
    waiting for a busy rank), said as a warning with where the late ranks are busy."""
    ref = events[min(events)]
    ranks = sorted(late)
    where = {r: (readable(views[r]) or [Position(Where.UNREADABLE)])[-1].callsite for r in ranks}
    summary = (f"{_waiting_in(events)} for {rank_list(ranks)}, which "
               f"{'is' if len(ranks) == 1 else 'are'} making progress outside the collectives "
               f"({late[ranks[0]]}) at {site(where[ranks[0]])}: late, not hung. Attach again later; if "
               f"{rank_list(ranks)} never {'calls' if len(ranks) == 1 else 'call'} {ref.op}, that is the hang.")
    details = _waiting_details(events)
    details += tuple(RankDetail(rank=r, role="late", where=where[r], note=late[r]) for r in ranks)
    return Finding(kind=Kind.STRAGGLER, severity=Severity.WARNING, summary=summary, op=ref.op, label=ref.label,
                   callsite=ref.callsite, waiting_ranks=tuple(sorted(events)), ranks=details,
                   data={"evidence": {str(r): late[r] for r in ranks}})


def judge(views: Mapping[int, RankView], world_size: int, scenario: Scenario, *, started: float, ended: float,
          notes: Sequence[str] = (), unread_why: str = "", unread_todo: str = "") -> Judged:
    """The verdict on the job as attach saw it, through ``diagnose.verdict`` like every other path.
    ``unread_why`` says why ranks of the job were not read (another node's attach never came), ``unread_todo``
    what to do about the ranks whose stacks could not be read (permission denied)."""
    events = _events(views, world_size, started)
    late = {r: words for r, v in views.items() if r not in events and v.state.alive and (words := progress(v))}
    end, why = _end(views, events, late, world_size)
    stuck = end in (EndReason.STALL, EndReason.CERTAIN_HANG)
    outcomes = {r: _outcome(v, None, events.get(r), stuck, late.get(r)) for r, v in views.items()}
    facts = RunFacts(world_size=world_size, end_reason=end, evidence=why, late_evidence=late,
                     detected_at=ended,   # no onset: attach did not see the last progress
                     unnumbered=not fr_joined(views))   # stacks alone: no groups or numbers (diagnose.apart)
    # A job caught mid-run has no whole records to compare: the rules get the open calls only for a hang (with
    # the Flight Recorder joined, also how far every other rank went in that group: its newest call there).
    compared = _compared(views, events) if end != EndReason.COMPLETED else {}
    evidence = Evidence(events=compared, outcomes=outcomes, facts=facts,
                        started_at=started, ended_at=ended)
    result = scenario_result(scenario, evidence, ended - started)
    findings = tuple(device.reworded(attach_words(f), _synced(views)) for f in result.findings)
    if end == EndReason.COMPLETED:
        findings += (late_finding(events, late, views),) if events and late else ()
        blocked = {r: at for r, at in _synced(views).items() if r not in events}
        if blocked:   # waiting on the device in a call nothing names: not decided
            findings = _undecided_first(findings, device.unknown_call(
                blocked, _elsewhere(views, events, late, blocked), any(v.fr for v in views.values())))
        unseen = unread_finding(events, views, world_size, unread_why, unread_todo)
        findings = _undecided_first(findings, unseen)
    undecided = findings[0].summary if findings and findings[0].data.get("not_decided") else None
    from distcheck.diagnose.rules import behaved_as_expected, observed_kinds

    observed = observed_kinds(findings)
    description = "\n".join([scenario.description or "", *notes]).strip() or None
    result = dataclasses.replace(result, findings=findings, observed=observed, description=description,
                                 ok=behaved_as_expected(scenario.expected, observed) and undecided is None,
                                 script=True, end_reason=EndReason.ATTACHED)   # the job was read, not ended
    return Judged(result, {r: [e] for r, e in events.items()}, undecided)


def _elsewhere(views: Mapping[int, RankView], events: Mapping[int, Event], late: Mapping[int, str],
               blocked: Mapping[int, Position]) -> dict[int, str]:
    """Where each rank read is, besides those blocked in a device sync, in the words the rank table's state uses."""
    out = {}
    for r, v in views.items():
        seen = readable(v)
        at = site(seen[-1].callsite) if seen else None
        if r in blocked or (not seen and v.state.alive):
            continue
        out[r] = (f"waiting in {events[r].op} at {site(events[r].callsite)}" if r in events else
                  "gone (its process had exited)" if not v.state.alive else
                  f"making progress outside the collectives ({late[r]}) at {at}" if r in late else
                  f"running outside any collective at {at}")
    return out


def _undecided_first(findings: tuple[Finding, ...], unseen: Finding | None) -> tuple[Finding, ...]:
    """Ranks nobody could read, and no error found among the others: "not decided" is the verdict, said first.
    With an error found (a rank gone), that decides: the ranks not read are a note after it."""
    if unseen is None:
        return findings
    if any(f.severity == "error" for f in findings):
        return (*findings, unseen)
    return (dataclasses.replace(unseen, data={**unseen.data, "not_decided": True}), *findings)


def unread(views: Mapping[int, RankView], world_size: int) -> list[int]:
    """The job's ranks nobody read (they run on other nodes, or their node's attach never came)."""
    return [r for r in range(world_size) if r not in views]


def unreadable(views: Mapping[int, RankView]) -> list[int]:
    """Ranks alive whose stacks could not be read in any sample (permission denied, py-spy failing): no evidence
    where they are, as if not read."""
    return sorted(r for r, v in views.items() if v.state.alive and not readable(v))


def _waiting_in(events: Mapping[int, Event]) -> str:
    """"Ranks 0, 2 wait in all_reduce called at train.py:30": the waiting ranks and their call, for a summary."""
    ref = events[min(events)]
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    verb = "waits" if len(events) == 1 else "wait"
    sides = calls_apart(events)
    if sides is not None:   # from outside, ranks at different calls: not one call (diagnose.apart)
        calls = ", ".join(call_words(events[ranks[0]]) for ranks in reversed(sides))
        return f"{rank_list(sorted(events)).capitalize()} wait in {len(sides)} different collectives ({calls})"
    return f"{rank_list(sorted(events)).capitalize()} {verb} in {ref.op} {called}"


def _waiting_details(events: Mapping[int, Event]) -> tuple[RankDetail, ...]:
    return tuple(RankDetail(rank=r, role="waiting", op=e.op, label=e.label, callsite=e.callsite)
                 for r, e in sorted(events.items()))


NODES_TODO = ("Run one distcheck attach per node of the job (--nnodes, --node-rank, --rdzv-endpoint; under Slurm: "
              "srun --overlap --jobid J --ntasks-per-node=1 distcheck attach).")


def unread_finding(events: Mapping[int, Event], views: Mapping[int, RankView], world_size: int, why: str,
                   todo: str = "") -> Finding | None:
    """Ranks of the job nobody read, or whose stacks could not be read: where they are is not known, so a hang is
    not decided (they may be on their way), said as a coverage warning naming the waiting ranks' call, if any, the
    ranks not read and what to do. None when every rank was read."""
    missing, blind = unread(views, world_size), unreadable(views)
    if not missing and not blind:
        return None
    said = [f"{rank_list(missing)} {'was' if len(missing) == 1 else 'were'} not read "
            f"({why or 'they run on other nodes'})"] if missing else []
    if blind:
        error = next((p.stack for p in views[blind[0]].positions if p.stack), "py-spy failed")
        said.append(f"the stacks of {rank_list(blind)} could not be read ({error.splitlines()[0]})")
    seen = f"{_waiting_in(events)}, and " if events else "no rank read waits in a collective, and "
    todo = " ".join(t for t in (NODES_TODO if missing else "", todo) if t)
    summary = f"Not decided: {seen}{'; '.join(said)}. {todo}".strip()
    ref = events[min(events)] if events else None
    return Finding(kind=Kind.COVERAGE, severity=Severity.WARNING, summary=summary, op=ref and ref.op,
                   label=ref and ref.label, callsite=ref and ref.callsite, waiting_ranks=tuple(sorted(events)),
                   ranks=_waiting_details(events),
                   data={"unread_ranks": list(missing), "unreadable_ranks": blind})


def attach_words(f: Finding) -> Finding:
    """The rules say "all_reduce #1 (group 0)"; from outside the number is not known: say "all_reduce"."""
    if f.op is None or f.seq != SEQ:
        return f
    summary = f.summary.replace(f" #{SEQ} (group {GROUP})", "").replace(f" #{SEQ} [group {GROUP}]", "")
    return dataclasses.replace(f, summary=summary)
