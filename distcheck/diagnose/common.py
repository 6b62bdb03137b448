"""What every rule shares: the run's facts, the (group, seq) matching table,
majority, and how to name a call or a rank's whereabouts in a sentence. Pure.

Calls are matched by (group, sequence number); what was *expected* at a
sequence number is decided by majority, and a tie is stated as a tie — never
"whichever rank file was read first".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distcheck.files.stacks import IDLE_IN_POOL
from distcheck.models import EndReason, Event, Finding, GroupKey, Kind, Phase, RankDetail, RankOutcome, RankState
from distcheck.text import site


# Ends that stop a run before every rank is done: what was left open is a hang, not a count difference.
ABNORMAL_ENDS = (EndReason.CERTAIN_HANG, EndReason.STALL, EndReason.BUSY_TIMEOUT, EndReason.TIMEOUT, EndReason.CRASH,
                 EndReason.POSTMORTEM,
                 EndReason.INTERRUPTED, EndReason.SLURM_TIME_LIMIT, EndReason.SLURM_CANCELLED,
                 EndReason.SLURM_PREEMPTED)

TableKey = tuple[GroupKey, tuple[int, ...]]   # (group, member ranks)
Table = Mapping[TableKey, Mapping[int, Mapping[int, Event]]]


@dataclass(frozen=True)
class RunFacts:
    """What the launcher knows about how the run ended."""

    world_size: int
    end_reason: str = EndReason.COMPLETED   # an EndReason, or its string
    stall_onset: float | None = None     # wall time of the last progress
    detected_at: float | None = None     # wall time the stall was declared
    timeout_s: float | None = None
    stall_timeout_s: float | None = None  # a wait this long for a late rank is reported (None: not known)
    straggler_min_lag_s: float = 0.1
    oom_kills: int | None = None         # OOM kills counted in distcheck's memory cgroup (None: no counter)
    command_exit: int | None = None      # ``run -- CMD``: the command's own exit status
    evidence: str | None = None          # why distcheck ended the run ("certain: ranks 1-3 finished")
    late_evidence: Mapping[int, str] | None = None   # rank -> the progress a late rank showed
    records_lost: tuple[int, ...] = ()   # ranks whose records went with a lost node: what they did is unknown
    # rank -> group -> the calls node 0 compared by digest only (``files.trace_window``); empty: every record
    elided: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    # rank -> (group, seq) -> when it began waiting on that async call's handle (``work.wait()``)
    waited: Mapping[int, Mapping[tuple[str, int], float]] = field(default_factory=dict)
    # rank -> the calls it entered after distcheck decided (its teardown's reactions: diagnose.teardown)
    after_decision: Mapping[int, Sequence[Event]] = field(default_factory=dict)
    # the single-process replay's answer for the torchmetrics results (``launch.replay``, run before judging;
    # ``analyze`` reads the one the run kept): None where there was none
    metric_reference: Mapping[str, Any] | None = None
    # calls read from outside (``distcheck attach`` without the Flight Recorder): no groups, no sequence numbers, no
    # fingerprints; ranks whose stacks stand at different calls are not known to be in one (``diagnose.apart``)
    unnumbered: bool = False



# -- matching ---------------------------------------------------------------


def _components(member_sets: Iterable[tuple[int, ...]]) -> list[set[int]]:
    """Merge overlapping member sets: ranks that share a group name and a rank meant the same group."""
    merged: list[set[int]] = []
    for members in member_sets:
        current = set(members)
        for other in [m for m in merged if m & current]:
            merged.remove(other)
            current |= other
        merged.append(current)
    return merged


def _member_sets(traces: Mapping[int, Sequence[Event]]) -> dict[str, set[tuple[int, ...]]]:
    sets: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for rank, events in traces.items():
        seen: dict[str, tuple[int, ...]] = {}
        for e in events:
            # Identity check first: hashing a 1000-rank tuple per event would dominate the run time.
            if seen.get(e.group) is not e.group_ranks:
                seen[e.group] = e.group_ranks
                sets[e.group].add(e.group_ranks or (rank,))
    return sets


def group_table(traces: Mapping[int, Sequence[Event]]) -> dict[TableKey, dict[int, dict[int, Event]]]:
    """{(group, members): {seq: {rank: event}}} over every rank's events.

    Disjoint subgroups that happen to share a name stay apart; overlapping member
    lists under one name are merged, so ranks that disagree about a group's
    members meet at the same (group, seq) and show up as a ``group`` mismatch.
    """
    keys: dict[tuple[str, tuple[int, ...]], TableKey] = {}
    for name, member_sets in _member_sets(traces).items():
        for component in _components(sorted(member_sets)):
            key = (GroupKey.of(name), tuple(sorted(component)))
            for members in member_sets:
                if set(members) <= component:
                    keys[(name, members)] = key
    table: dict[TableKey, dict[int, dict[int, Event]]] = defaultdict(lambda: defaultdict(dict))
    for rank, events in traces.items():
        # Keep the group's own dict, not its key: hashing a 1000-rank member tuple per event is slow.
        cache: dict[str, tuple[tuple[int, ...], dict[int, dict[int, Event]]]] = {}
        for e in events:
            hit = cache.get(e.group)
            if hit is None or hit[0] is not e.group_ranks:
                hit = cache[e.group] = (e.group_ranks, table[keys[(e.group, e.group_ranks or (rank,))]])
            hit[1][e.seq][rank] = e
    return table


# What a healthy rank says when a *peer* died or never came.
PEER_FAILURE_MARKERS = (
    "connection closed by peer", "connection reset by peer", "remote worker", "broken pipe",
    "communicator was aborted", "timed out", "timeout", "connection refused", "socket closed",
)


def _failure_words(error: str) -> str:
    """'when a peer was gone (Connection closed by peer)': the backend's words that say so, the same on every
    rank (no address or port); another error by its first line."""
    low = error.lower()
    marker = next((m for m in PEER_FAILURE_MARKERS if m in low), None)
    if marker is not None:
        start = low.index(marker)
        return f"when a peer was gone ({error[start:start + len(marker)]})"
    first = error.strip().splitlines()[0] if error.strip() else error
    return f"with {first[:160]}"


def is_peer_failure(exception: str | None) -> bool:
    """The rank's error is its reaction to a peer's end (the peer died or never came), not its own fault."""
    text = (exception or "").lower()
    return any(marker in text for marker in PEER_FAILURE_MARKERS)


def majority(values: Mapping[int, Any]) -> tuple[Any, list[int], bool]:
    """(majority value, odd ranks, tie) over rank → value. On a tie there is no odd side."""
    ranked = Counter(values.values()).most_common()
    top_value, top_count = ranked[0]
    if len(ranked) > 1 and ranked[1][1] == top_count:
        return None, [], True
    return top_value, sorted(r for r, v in values.items() if v != top_value), False


def detail(rank: int, role: str, e: Event | None, **extra: Any) -> RankDetail:
    if e is None:
        return RankDetail(rank=rank, role=role, **extra)
    return RankDetail(rank=rank, role=role, op=e.op, seq=e.seq, label=e.label, callsite=e.callsite,
                      fingerprint=e.fingerprint(), **extra)


def who(e: Event) -> str:
    label = f"{e.label} " if e.label else ""
    return f"{label}at {site(e.callsite)}"


def call(e: Event) -> str:
    return f"{e.op} #{e.seq} (group {e.group})"



def whereabouts(rank: int, outcome: RankOutcome | None, last: Event | None = None) -> str:
    if outcome is None:
        return f"no status; its trace ends after {call(last)}" if last else "never started"
    if outcome.state == RankState.FINISHED:
        left = f"; it ended its work early at {outcome.where}" if outcome.where else ""   # rank.exit_site
        return f"finished, now idle{left}"
    if outcome.state == RankState.CRASHED:
        cause = outcome.exception or (f"killed by {outcome.signal}" if outcome.signal
                                      else f"exit code {outcome.exit_code}")
        return f"crashed ({cause})"
    if outcome.state == RankState.STUCK and outcome.last_event is not None:
        e = outcome.last_event
        error = e.error or (outcome.exception if outcome.phase == Phase.ERROR else None)
        if error:   # it was not waiting at the end: the call raised, and the rank exited with that error
            return f"failed in {call(e)} {who(e)} {_failure_words(error)}"
        return f"waiting in {call(e)} {who(e)}"
    if outcome.phase == Phase.STARTING:
        return "still starting up (init_process_group)"
    if outcome.where == IDLE_IN_POOL:
        return IDLE_IN_POOL
    if outcome.where:
        return f"running outside any collective at {site(outcome.where)}"
    return outcome.state



# -- agreement -----------------------------------------------------------------


def contradicts(f: Finding, outcomes: Mapping[int, RankOutcome]) -> bool:
    """A hang finding that puts a rank in a call its outcome says it was not in at the end:
    it had finished, or it was stuck in another call."""
    if f.kind is not Kind.HANG or f.seq is None:
        return False
    # a cycle puts each rank in its own part's call
    parts = {r: (p.get("group"), p.get("seq"), p.get("op"))
             for p in f.data.get("cycle") or () for r in p.get("ranks", ())}
    for r in f.waiting_ranks:
        o = outcomes.get(r)
        if o is None:
            continue
        if o.state == RankState.FINISHED:
            return True
        e = o.last_event
        if (o.state == RankState.STUCK and e is not None
                and (e.group, e.seq, e.op) != parts.get(r, (f.group, f.seq, f.op))):
            return True
    return False


def agreeing(findings: Sequence[Finding], outcomes: Mapping[int, RankOutcome]) -> list[Finding]:
    """Every finding but the first that contradicts where a rank was at the end is dropped: the first
    is the main finding, and a second one must never tell another story about the same rank."""
    return list(findings[:1]) + [f for f in findings[1:] if not contradicts(f, outcomes)]
