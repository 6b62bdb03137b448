"""Crashes: the root-cause failure among the ranks that died, and what its
peers were doing meanwhile (outcomes already tell primary failures from
their consequences). Pure.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from distcheck.diagnose.common import RunFacts, call, whereabouts
from distcheck.models import EndReason, Event, Finding, RankDetail, RankOutcome, RankState
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


def find_crashes(outcomes: Mapping[int, RankOutcome], facts: RunFacts,
                 mismatches: Sequence[Finding] = ()) -> list[Finding]:
    """The root-cause crash (outcomes already tell primary failures from their consequences)."""
    crashed = [o for _, o in sorted(outcomes.items()) if o.state == RankState.CRASHED]
    if not crashed:
        return []
    root = sorted(crashed, key=lambda o: _root_first(o, facts))[0]
    inside = _inside(root)
    cause = next((m for m in mismatches if inside and (m.group, m.seq) == (inside.group, inside.seq)), None)
    peers = sorted(r for r, o in outcomes.items() if o.state != RankState.CRASHED)
    details = [RankDetail(rank=o.rank, role="crashed", state=o.state, where=o.where,
                          op=_inside(o).op if _inside(o) else None, seq=_inside(o).seq if _inside(o) else None,
                          note=o.exception or o.signal or f"exit code {o.exit_code}") for o in crashed]
    details += [RankDetail(rank=r, role="peer", state=outcomes[r].state, where=outcomes[r].where,
                           note=whereabouts(r, outcomes[r])) for r in peers]
    last = inside or root.last_event
    data = {"root_rank": root.rank, "exception": root.exception, "signal": root.signal, "exit_code": root.exit_code}
    if root.signal == "SIGKILL":
        data.update(oom_kills=facts.oom_kills, rss_bytes=root.rss_bytes, peak_rss_bytes=root.peak_rss_bytes)
    if cause is not None:
        data["caused_by"] = {"kind": cause.kind, "group": cause.group, "seq": cause.seq, "fields": list(cause.fields)}
    return [Finding(
        kind="crash", severity="error",
        summary=_crash_summary(root, inside, cause, crashed, outcomes) + _sigkill_note(root, facts),
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        label=last.label if last else None, callsite=root.where or (inside.callsite if inside else None),
        odd_ranks=(root.rank,), ranks=tuple(details), data=data,
    )]


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
    same = [o.rank for o in crashed if o.rank != root.rank and _cause_text(o) == _cause_text(root)]
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
    return [Finding(kind="crash", severity="error", data={"command_exit": facts.command_exit},
                    summary=(f"Every rank finished, but the command itself exited with code {facts.command_exit}: "
                             f"something outside the ranks failed (its launcher, or code before or after them). "
                             f"Its own output is in logs/command.log in the launch dir."))]
