"""Crashes: the root-cause failure among the ranks that died, and what its
peers were doing meanwhile (outcomes already tell primary failures from
their consequences). Pure.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from distcheck.diagnose.common import RunFacts, call, whereabouts
from distcheck.models import Cause, EndReason, Event, Finding, Kind, RankDetail, RankOutcome, RankState, Severity
from distcheck.text import gib, plural, rank_list, site


def _cause_text(o: RankOutcome) -> str:
    if o.exception and o.signal:   # a C++ exception that aborted the process: its message from the log
        return f"was killed by {o.signal} ({o.exception})"
    if o.exception:
        return f"raised {o.exception}"
    if o.signal:
        return f"was killed by {o.signal}"
    if o.exit_code is None:   # a rank of the user's own launch command: no exit status reaches distcheck
        return ("died in the middle of its work without a Python exception (killed by a signal such as "
                "SIGKILL, or os._exit; its exit status is not known: the user's command started it)")
    return f"exited with code {o.exit_code}"


# What differs between ranks that failed the same way: object addresses ("<ProcessGroup object at 0x7f...>"),
# a peer's address and port ("[127.0.0.1]:64693").
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\[[0-9a-fA-F.:]+\]:\d+")


def _failure(o: RankOutcome) -> str:
    """How a rank failed, said the same way for every rank that failed so."""
    return _VARYING.sub("…", _cause_text(o))


def _inside(o: RankOutcome) -> Event | None:
    """The collective a rank died in: its last one, when that never returned or returned an error."""
    e = o.last_event
    return e if e is not None and (e.t_exit is None or e.error) else None


def _root_first(o: RankOutcome, facts: RunFacts) -> tuple[bool, bool, int, int]:
    """A Python exception is the clearest root cause; then signals; then bare exit codes. When the
    OOM killer killed, the rank that used the most memory was its first victim: the kernel can kill
    again before the first victim's memory is back, and takes the next largest."""
    oom_victim = facts.oom_kills and o.signal == "SIGKILL"
    return o.exception is None, o.signal is None, -((o.peak_rss_bytes or o.rss_bytes or 0) if oom_victim else 0), o.rank


def find_crashes(outcomes: Mapping[int, RankOutcome], facts: RunFacts) -> list[Finding]:
    """The root-cause crash (outcomes already tell primary failures from their consequences); a mismatch in
    the call it died in is linked to it afterwards (``because_of``)."""
    crashed = [o for _, o in sorted(outcomes.items()) if o.state == RankState.CRASHED]
    if not crashed:
        return []
    root = sorted(crashed, key=lambda o: _root_first(o, facts))[0]
    # every rank that failed as the root did is a root too (the same error on several ranks, each its own); not the
    # OOM killer's later victims (the first one's memory named it)
    roots = tuple(o.rank for o in crashed if _failure(o) == _failure(root)
                  and _root_first(o, facts)[:3] == _root_first(root, facts)[:3])
    inside = _inside(root)
    peers = sorted(r for r, o in outcomes.items() if o.state != RankState.CRASHED)
    details = [RankDetail(rank=o.rank, role="crashed", state=o.state, where=o.where,
                          op=i.op if (i := _inside(o)) else None, seq=i.seq if i else None,
                          note=o.exception or o.signal or f"exit code {o.exit_code}") for o in crashed]
    details += [RankDetail(rank=r, role="peer", state=outcomes[r].state, where=outcomes[r].where,
                           note=whereabouts(r, outcomes[r])) for r in peers]
    last = inside or root.last_event
    data = {"root_rank": root.rank, "root_ranks": list(roots), "exception": root.exception, "signal": root.signal,
            "exit_code": root.exit_code}
    if root.signal == "SIGKILL":
        data.update(oom_kills=facts.oom_kills, rss_bytes=root.rss_bytes, peak_rss_bytes=root.peak_rss_bytes)
    return [Finding(
        kind=Kind.CRASH, severity=Severity.ERROR,
        summary=_crash_summary(root, inside, None, crashed, outcomes) + _sigkill_note(root, facts),
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        label=last.label if last else None, callsite=root.where or (inside.callsite if inside else None),
        odd_ranks=roots, ranks=tuple(details), data=data,
    )]


def because_of(crash: Finding, mismatches: Sequence[Finding], outcomes: Mapping[int, RankOutcome],
               facts: RunFacts) -> Finding:
    """The crash as the consequence of the mismatch in the very call its root rank died in, where there is
    one (gloo aborts a rank that receives a buffer of another size); else the crash as it is."""
    root = outcomes.get(crash.data.get("root_rank", -1))
    inside = _inside(root) if root is not None else None
    cause = next((m for m in mismatches if inside and (m.group, m.seq) == (inside.group, inside.seq)), None)
    if cause is None or root is None:   # a cause is found only inside the root rank's call
        return crash
    crashed = [o for _, o in sorted(outcomes.items()) if o.state == RankState.CRASHED]
    return dataclasses.replace(
        crash, summary=_crash_summary(root, inside, cause, crashed, outcomes) + _sigkill_note(root, facts),
        caused_by=Cause.of(cause, fields=True))


_SIZE_FIELDS = {"shape", "shapes", "count", "bytes", "splits", "numel"}   # what leaves a rank a result of another size


def after_a_mismatch(crash: Finding, mismatches: Sequence[Finding], outcomes: Mapping[int, RankOutcome],
                     traces: Mapping[int, Sequence[Event]]) -> Finding:
    """The crash as the likely consequence of an earlier size mismatch: its root rank died outside every collective
    after returning from a call whose sizes differed between the ranks (gloo lets some through: a rank of
    ``torch.bincount`` without ``minlength`` all-reduced 4 values against its peer's 5, then raised in
    ``cross_entropy``). Linked whatever order the two were seen in; else the crash as it is."""
    root_rank = crash.data.get("root_rank", -1)
    root = outcomes.get(root_rank)
    if crash.caused_by is not None or root is None or _inside(root) is not None:
        return crash
    returned = {(e.group, e.seq) for e in traces.get(root_rank, ()) if e.t_exit is not None and not e.error}
    cause = next((m for m in mismatches if m.kind is Kind.MISMATCH and _SIZE_FIELDS & set(m.fields)
                  and (m.group, m.seq) in returned), None)
    if cause is None:
        return crash
    said = (f" It most likely follows from the {' and '.join(cause.fields)} mismatch in {cause.op} #{cause.seq} "
            f"at {site(cause.callsite)}, which rank {root_rank} returned from earlier with a result of another size "
            f"than its peers' (see the mismatch finding).")
    return dataclasses.replace(crash, summary=crash.summary + said, caused_by=Cause.of(cause, fields=True))


def _crash_summary(root: RankOutcome, inside: Event | None, cause: Finding | None,
                   crashed: Sequence[RankOutcome], outcomes: Mapping[int, RankOutcome]) -> str:
    summary = f"Rank {root.rank} {_cause_text(root)}"
    if inside is not None:
        summary += f" inside {call(inside)}"
    where = root.where or (inside.callsite if inside else None)
    if where:
        summary += f" at {site(where)}"
    if cause is not None:
        summary += (f" — most likely a consequence of the {' and '.join(cause.fields)} mismatch in that very "
                    f"collective (see the mismatch finding)")
        if {"shape", "dtype", "splits", "bytes"} & set(cause.fields):
            summary += ": gloo aborts a process that receives a buffer of another size than it expects"
    same = [o.rank for o in crashed if o.rank != root.rank and _failure(o) == _failure(root)]
    if same:
        summary += f"; {rank_list(same)} failed the same way"
    summary += "".join(f"; rank {o.rank} {_cause_text(o)}" for o in crashed
                       if o.rank != root.rank and o.rank not in same)
    groups: dict[str, list[int]] = defaultdict(list)
    for r, o in sorted(outcomes.items()):
        if o.state != RankState.CRASHED:
            groups[whereabouts(r, o)].append(r)
    if groups:
        summary += "; meanwhile " + "; ".join(f"{rank_list(rs)} {w}" for w, rs in groups.items())
    return summary + "."


def _sigkill_note(o: RankOutcome, facts: RunFacts) -> str:
    """Who sent a SIGKILL that distcheck did not send: the OOM killer, as far as the facts say."""
    if o.signal != "SIGKILL":
        return ""
    used = ""
    if o.rss_bytes is not None:
        used = f"; rank {o.rank} was last seen using {gib(o.rss_bytes)} resident"
        if o.peak_rss_bytes and o.peak_rss_bytes > o.rss_bytes:
            used += f" (peak {gib(o.peak_rss_bytes)})"
    if facts.oom_kills:
        return (f" The kernel's OOM killer sent that SIGKILL: the memory cgroup distcheck runs in counted "
                f"{plural(facts.oom_kills, 'OOM kill')} during the run{used}.")
    if facts.oom_kills == 0:
        return (f" distcheck did not send that SIGKILL, and the memory cgroup it runs in counted no OOM kill during "
                f"the run: it came from elsewhere (a scheduler, an operator, another cgroup's OOM killer){used}.")
    return f" distcheck did not send that SIGKILL; the kernel's OOM killer is the usual sender (see dmesg){used}."


def find_command_failure(facts: RunFacts) -> list[Finding]:
    """``run -- CMD``: every rank finished, yet the command itself failed (its launcher, or code it ran
    before or after the ranks): a crash no rank explains."""
    if facts.end_reason != EndReason.COMPLETED or facts.command_exit in (None, 0):
        return []
    return [Finding(kind=Kind.CRASH, severity=Severity.ERROR, data={"command_exit": facts.command_exit},
                    summary=(f"Every rank finished, but the command itself exited with code {facts.command_exit}: "
                             f"something outside the ranks failed (its launcher, or code before or after them). "
                             f"Its own output is in logs/command.log in the launch dir."))]
