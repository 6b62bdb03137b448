"""From what attach read of each rank to the run path's own verdict: the positions become the records
the rules take (an open ``Event`` per rank waiting in a collective, a ``RankOutcome`` per rank), the
wait-for graph (``launch.waitfor``) says when the hang is certain, the watchdog's evidence of progress
(``launch.procs.ActivityMeter``'s counters, ``launch.watchdog.BUSY_CPU``, a stack that moved) tells a
late rank from a stuck one, and ``diagnose.verdict`` gives the findings. Pure.

Read from outside there are no sequence numbers: every rank waiting in a collective is taken to wait
in the call open now on the default group (``#1``), which the report words drop (``attach_words``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from distcheck.attach.flight import FrCall, FrState, members, open_call
from distcheck.attach.position import Position
from distcheck.attach.read import ProcState
from distcheck.diagnose.common import RunFacts
from distcheck.diagnose.verdict import Evidence, Scenario, scenario_result
from distcheck.launch.procs import Activity
from distcheck.launch.waitfor import certain_hang
from distcheck.launch.progress import BUSY_CPU, RankProgress
from distcheck.models import EndReason, Event, Finding, Phase, RankDetail, RankOutcome, RankState, ScenarioResult
from distcheck.text import rank_list, site, size

GROUP, SEQ = "0", 1          # the call open now, on the default group: what attach can tell from outside
# A rank blocked in one collective sleeps in the backend's wait: its main thread does not wake. One that
# wakes while seen in "the same" call is completing calls one after another (a healthy loop).
MAX_WAKEUPS_WAITING = 2
# I/O below this rate is a log line now and then (a heartbeat thread, a logger's flush), not work that brings
# the rank to the call: 32 idle ranks whose ticker thread logged 81 B in 10 s read as late, and the hang was missed.
IO_FLOOR_BPS = 1024
RUNNING_CPU = 0.01   # with the main thread running in most samples: a starved busy rank, not a poll loop


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


def waiting_in(view: RankView) -> Position | None:
    """The collective the rank waits in: the same one, at the same stack, in every sample, without waking.
    A native wait is read only in the last sample (it pauses the rank): the Python stack of the others,
    the same, stands for it."""
    seen = readable(view)
    last = seen[-1] if seen else None
    if not view.state.alive or len(seen) < 2 or last.kind != "collective":
        return None
    if any(p.digest != last.digest or (p.op != last.op and last.native_wait is None) for p in seen):
        return None
    if view.activity is not None and view.activity.wakeups > MAX_WAKEUPS_WAITING:
        return None
    return last


def readable(view: RankView) -> list[Position]:
    """The samples py-spy could read: on a loaded node one read of 32 may time out, and an unreadable sample
    is no evidence that the rank moved (it made rank 0 of a 32-rank hang look like it had left its call)."""
    return [p for p in view.positions if p.kind != "unreadable"]


def progress(view: RankView) -> str | None:
    """The evidence that a rank outside the collectives makes progress, in the watchdog's words; None when
    it shows none. A main thread that only wakes (a loop polling a file with ``time.sleep``) is idle here:
    attach judges within seconds, and such a loop wakes for ever; under load a sample finds it on the loop's
    other line now and then (one of 32 polling ranks read as late, and the hang was missed), so a move counts
    only from one function to another."""
    said = []
    act = view.activity
    if act is not None and act.cores >= BUSY_CPU:
        said.append(f"its processes used {act.cores:.1f} cores")
    if act is not None and act.io_bytes >= IO_FLOOR_BPS * act.span:
        said.append(f"read or wrote {size(act.io_bytes)} in {act.span:.1f} s")
    seen = readable(view)
    ran = sum(p.active for p in seen)
    if ran and 2 * ran >= len(seen) and act is not None and act.cores >= RUNNING_CPU:
        # A rank computing on a crowded node gets a few hundredths of a core (under BUSY_CPU) but runs whenever
        # it is read; a polling rank sleeps in nearly every read, and one waiting for a core after each sleep
        # (runnable, so "running" to py-spy) uses next to no CPU.
        said.append(f"its main thread was running in {ran} of {len(seen)} samples ({act.cores:.2f} cores)")
    if len({p.calls for p in seen}) > 1:
        said.append("its stack moved")   # from one function to another: a line polled in a loop is not work
    return ", ".join(said) or None


def _event(view: RankView, at: Position, world: int, t: float) -> Event:
    return Event(rank=view.rank, group=GROUP, seq=SEQ, op=at.op or "collective", t_enter=t, callsite=at.callsite,
                 library_callsite=at.library_callsite, label=at.label, group_ranks=tuple(range(world)),
                 native=at.native_wait is not None)


def _outcome(view: RankView, at: Position | None, event: Event | None, stuck: bool, late: str | None) -> RankOutcome:
    last = (readable(view) or list(view.positions) or [Position("unreadable")])[-1]
    common = dict(rank=view.rank, host=view.host, node=view.node, pid=view.pid, stack=last.stack or None,
                  phase=Phase.RUNNING)
    if not view.state.alive:
        return RankOutcome(state=RankState.CRASHED, exception="gone: its process had exited when attach read it",
                           **common)
    if event is not None:
        return RankOutcome(state=RankState.STUCK if stuck else RankState.RUNNING, last_event=event,
                           where=event.callsite, collectives=1, **common)
    where = last.callsite or (f"in the kernel at {view.state.wchan}" if view.state.wchan else None)
    return RankOutcome(state=RankState.RUNNING, where=where, busy_at=where if late else None, **common)


def _progress_of(view: RankView, event: Event | None, world: tuple[int, ...], joined: bool) -> RankProgress:
    """What the wait-for graph reads of a rank: waiting in the open call, or running (it may yet come); with
    the Flight Recorder joined, how far it went in each group."""
    group_ranks = (event.group_ranks or world) if event else ()
    waits = ((event.group, event.seq, group_ranks, f"{event.op} {group_ranks}"),) if event else ()
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
    if unread(views, world_size):
        return EndReason.COMPLETED, None
    absent = [r for r in views if r not in events]
    if any(r in late for r in absent):
        return EndReason.COMPLETED, None
    samples = len(next(iter(views.values())).positions)
    if not absent:
        return EndReason.STALL, f"every rank in it, none out of it in {samples} samples"
    return EndReason.STALL, (f"certain from outside: {rank_list(absent)} idle outside every collective "
                             f"(no CPU, no I/O beyond {size(IO_FLOOR_BPS)}/s, in the same functions in {samples} samples); "
                             f"{rank_list(sorted(events))} in the same call in every sample{_fr_words(views, events)}")


def _fr_words(views: Mapping[int, RankView], events: Mapping[int, Event]) -> str:
    """Which evidence the verdict rests on besides the stacks: the Flight Recorder, joined by sequence number."""
    if not fr_joined(views):
        return " (stacks and /proc only: no Flight Recorder dump to join)"
    ref = events[min(events)]
    behind = sorted(r for r, v in views.items() if v.fr and v.fr.entered.get(ref.group, 0) < ref.seq)
    return (f"; the Flight Recorder dumps of every rank, joined by sequence number: {ref.op} #{ref.seq} "
            f"[group {ref.group}] in flight on {rank_list(sorted(events))}"
            + (f", never entered by {rank_list(behind)}" if behind else ""))


def fr_joined(views: Mapping[int, RankView]) -> bool:
    """Whether the Flight Recorder is joined: every rank read has a dump, and every rank whose stack waits in a
    collective has that call in flight in it (else the dumps are older than the hang)."""
    states = {r: v.fr for r, v in views.items() if v.fr is not None}
    if not views or len(states) != len(views):
        return False
    return all(open_call(r, states) is not None for r, v in views.items() if waiting_in(v) is not None)


def _events(views: Mapping[int, RankView], world_size: int, started: float) -> dict[int, Event]:
    """The call each waiting rank is in: from its stack (the default group's open call), or, with the Flight
    Recorder joined, the call in flight in its dump (its group and number), also for a rank whose Python thread
    is past it (an async op's ``wait()``, NCCL's kernels) and sits idle."""
    joined = fr_joined(views)
    states = {r: v.fr for r, v in views.items() if v.fr is not None} if joined else {}
    out = {}
    for r, v in views.items():
        at = waiting_in(v)
        call = open_call(r, states) if joined else None
        if call is not None and (at is not None or (v.state.alive and progress(v) is None)):
            out[r] = _fr_event(v, at, call, members(call.group, states, world_size), started)
        elif at is not None and not joined:
            out[r] = _event(v, at, world_size, started)
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
    last = (readable(view) or [Position("unreadable")])[-1]
    op = at.op if at is not None and at.op not in (None, "collective") else call.op
    return Event(rank=view.rank, group=call.group, seq=call.seq, op=op, t_enter=t, shapes=call.shapes,
                 dtypes=call.dtypes, callsite=(at or last).callsite or call.callsite,
                 library_callsite=at.library_callsite if at else None, label=at.label if at else None,
                 group_ranks=group_ranks, native=at is None or at.native_wait is not None)


def late_finding(events: Mapping[int, Event], late: Mapping[int, str], views: Mapping[int, RankView]) -> Finding:
    """Ranks wait in a call while the others make progress outside: late, not hung (as the watchdog keeps
    waiting for a busy rank), said as a warning with where the late ranks are busy."""
    ref = events[min(events)]
    ranks = sorted(late)
    where = {r: (readable(views[r]) or [Position("unreadable")])[-1].callsite for r in ranks}
    summary = (f"{_waiting_in(events)} for {rank_list(ranks)}, which "
               f"{'is' if len(ranks) == 1 else 'are'} making progress outside the collectives "
               f"({late[ranks[0]]}) at {site(where[ranks[0]])}: late, not hung. Attach again later; if "
               f"{rank_list(ranks)} never {'calls' if len(ranks) == 1 else 'call'} {ref.op}, that is the hang.")
    details = _waiting_details(events)
    details += tuple(RankDetail(rank=r, role="late", where=where[r], note=late[r]) for r in ranks)
    return Finding(kind="straggler", severity="warning", summary=summary, op=ref.op, label=ref.label,
                   callsite=ref.callsite, waiting_ranks=tuple(sorted(events)), ranks=details,
                   data={"evidence": {str(r): late[r] for r in ranks}})


def judge(views: Mapping[int, RankView], world_size: int, scenario: Scenario, *, started: float, ended: float,
          notes: Sequence[str] = (), unread_why: str = "") -> Judged:
    """The verdict on the job as attach saw it, through ``diagnose.verdict`` like every other path.
    ``unread_why`` says why ranks of the job were not read (another node's attach never came)."""
    events = _events(views, world_size, started)
    late = {r: words for r, v in views.items() if r not in events and v.state.alive and (words := progress(v))}
    end, why = _end(views, events, late, world_size)
    stuck = end in (EndReason.STALL, EndReason.CERTAIN_HANG)
    outcomes = {r: _outcome(v, None, events.get(r), stuck, late.get(r)) for r, v in views.items()}
    facts = RunFacts(world_size=world_size, end_reason=end, evidence=why, late_evidence=late,
                     detected_at=ended)   # no onset: attach did not see the last progress
    # A job caught mid-run has no whole records to compare: the rules get the open calls only for a hang (with
    # the Flight Recorder joined, also how far every other rank went in that group: its newest call there).
    compared = _compared(views, events) if end != EndReason.COMPLETED else {}
    evidence = Evidence(events=compared, outcomes=outcomes, facts=facts,
                        started_at=started, ended_at=ended)
    result = scenario_result(scenario, evidence, ended - started)
    missing = unread(views, world_size)
    extra = (late_finding(events, late, views),) if events and end == EndReason.COMPLETED and late else ()
    extra += (unread_finding(events, missing, unread_why),) if events and end == EndReason.COMPLETED and missing \
        else ()
    findings = tuple(attach_words(f) for f in result.findings) + extra
    from distcheck.diagnose.rules import behaved_as_expected, observed_kinds

    observed = observed_kinds(findings)
    description = "\n".join([scenario.description or "", *notes]).strip() or None
    result = dataclasses.replace(result, findings=findings, observed=observed, description=description,
                                 ok=behaved_as_expected(scenario.expected, observed), script=True,
                                 end_reason=EndReason.ATTACHED)   # the job was read, not ended
    return Judged(result, {r: [e] for r, e in events.items()})


def unread(views: Mapping[int, RankView], world_size: int) -> list[int]:
    """The job's ranks nobody read (they run on other nodes, or their node's attach never came)."""
    return [r for r in range(world_size) if r not in views]


def _waiting_in(events: Mapping[int, Event]) -> str:
    """"Ranks 0, 2 wait in all_reduce called at train.py:30": the waiting ranks and their call, for a summary."""
    ref = events[min(events)]
    called = f"called from {ref.label} at {site(ref.callsite)}" if ref.label else f"called at {site(ref.callsite)}"
    verb = "waits" if len(events) == 1 else "wait"
    return f"{rank_list(sorted(events)).capitalize()} {verb} in {ref.op} {called}"


def _waiting_details(events: Mapping[int, Event]) -> tuple[RankDetail, ...]:
    return tuple(RankDetail(rank=r, role="waiting", op=e.op, label=e.label, callsite=e.callsite)
                 for r, e in sorted(events.items()))


def unread_finding(events: Mapping[int, Event], missing: Sequence[int], why: str) -> Finding:
    """Ranks wait in a call, and some ranks of the job were not read: the hang is not decided (they may be on
    their way), said as a coverage warning naming the waiting ranks' call and the ranks to read."""
    ref = events[min(events)]
    summary = (f"{_waiting_in(events)}, and {rank_list(missing)} "
               f"{'was' if len(missing) == 1 else 'were'} not read ({why or 'they run on other nodes'}): "
               f"not decided. Run one distcheck attach per node of the job (--nnodes, --node-rank, "
               f"--rdzv-endpoint; under Slurm: srun --overlap --jobid J --ntasks-per-node=1 distcheck attach).")
    details = _waiting_details(events)
    return Finding(kind="coverage", severity="warning", summary=summary, op=ref.op, label=ref.label,
                   callsite=ref.callsite, waiting_ranks=tuple(sorted(events)), ranks=details,
                   data={"unread_ranks": list(missing)})


def attach_words(f: Finding) -> Finding:
    """The rules say "all_reduce #1 (group 0)"; from outside the number is not known: say "all_reduce"."""
    if f.op is None or f.seq != SEQ:
        return f
    summary = f.summary.replace(f" #{SEQ} (group {GROUP})", "").replace(f" #{SEQ} [group {GROUP}]", "")
    return dataclasses.replace(f, summary=summary)
