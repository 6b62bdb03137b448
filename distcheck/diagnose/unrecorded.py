"""A C++-issued call a rank died in before its record had it. Pure.

DTensor's ``full_tensor()`` issues a functional all_gather from C++; the native sidecar records it
at its next poll. When gloo aborts the rank inside that call first (a peer's all_gather of another
size met it), the rank's record ends with the call before, which returned. Its stack at the abort
(faulthandler) still shows the functional collective and the API the user called
(``library_shapes.functional_call_in``), so the call is known: the number where the peers' own calls
were broken off. ``with_unrecorded_calls`` puts it in the rank's outcome, so every rule pairs it with
the peers' by (group, seq); ``unrecorded_finding`` is the mismatch gloo's abort then tells.

The number does not rest on how far the dying rank's sidecar got: it polls, and gloo's abort can
come before its first poll (an empty record), while an earlier call was still open in it (a stale
open record), or after the whole run up to the call. The peers' records are whole (their ranks are
stopped only once synced), and a collective they returned from needs every member's entry, so the
rank had entered every call the peers returned from: the call it died in is the first number where
the peers were broken off. Every run then names the same rank, number and lines.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import TypeGuard

from distcheck.diagnose.common import Table, TableKey, detail, is_peer_failure, majority, who
from distcheck.files.stacks import parse_dumps, user_top
from distcheck.knowledge.library_shapes import FunctionalCall, functional_call_in, wire_op
from distcheck.models import Event, Finding, Kind, RankOutcome, RankState, Severity
from distcheck.text import call_site, field_value, rank_list, site

UNRECORDED = "issued from C++, not yet recorded when the rank died"


def is_unrecorded(e: Event | None) -> TypeGuard[Event]:
    return e is not None and e.native and e.label is not None and e.label.endswith(f"({UNRECORDED})")


def _functional_in_stack(stack: str | None) -> tuple[FunctionalCall, str | None] | None:
    """(the functional call, the user's line) of the thread a dump shows inside one."""
    if not stack:
        return None
    for dump in reversed(parse_dumps(stack)):
        for thread in reversed(dump.threads):   # faulthandler lists the main thread last
            frames = [(f.file, f.line, f.function) for f in thread.frames]
            found = functional_call_in(frames)
            if found is not None:
                top = user_top(thread.frames)
                return found, (call_site(top.file, top.line, top.function) if top else None)
    return None


# Calls whose return on a peer does not prove that every member entered them: gloo's monitored_barrier
# (P2P with the root) and a call a peer made alone (a new_group of its own members).
_ALONE = ("monitored_barrier", "new_group")


def _returned(e: Event) -> bool:
    """The call returned on its rank after it was done: an async call's exit only says it was queued."""
    return e.completed and not e.error and (e.native or not e.async_op)


def _stopped_in(peer: int, evs: Mapping[int, Event], peers: Mapping[int, RankOutcome]) -> bool:
    """The peer was inside this call when the run broke off: it never returned from it, or it is a C++-issued
    call and the peer's last, and the peer did not finish (its sidecar closes what is open when the rank
    fails or is stopped, and gloo's Flight Recorder retires a failed call like one that returned)."""
    e = evs[peer]
    if not _returned(e):
        return True
    o = peers.get(peer)
    last = o.last_event if o is not None else None
    return (e.native and last is not None and (last.group, last.seq) == (e.group, e.seq)
            and o is not None and o.state != RankState.FINISHED
            and (o.exception is None or is_peer_failure(o.exception)))


def _broken_off(rank: int, seqs: Mapping[int, Mapping[int, Event]], peers: Mapping[int, RankOutcome]) -> int | None:
    """The first number of a group where ``rank``'s peers were inside a call when the run broke off, when
    every call before it that the peers returned from is one every member must enter (so ``rank`` entered
    it too); None when the peers were broken off nowhere, or a call before may have left the rank out."""
    stopped = sorted(s for s, evs in seqs.items() if any(_stopped_in(r, evs, peers) for r in evs if r != rank))
    # A call a peer returned from and went on needed the rank too, so it died later than that (the peer
    # that seems stopped there was stopped by distcheck between that call and the next one).
    first = next((s for s in stopped if all(_stopped_in(r, seqs[s], peers) for r in seqs[s] if r != rank)), None)
    if first is None:
        return None
    before = (e for s, evs in seqs.items() if s < first for r, e in evs.items() if r != rank)
    return None if any(e.op in _ALONE for e in before) else first


def _behind(rank: int, seqs: Mapping[int, Mapping[int, Event]], first: int) -> bool:
    """The rank's record in the group ends before ``first``: with a call that returned, or with a C++-issued
    call its sidecar saw open that the peers returned from (the poll before the rank died was the last one).
    A Python-issued call is written before it starts: a record that ends open there is where the rank was."""
    mine = [(s, evs[rank]) for s, evs in seqs.items() if rank in evs]
    if not mine:
        return True
    seq, last = max(mine, key=lambda x: x[0])
    return seq < first and (_returned(last) or last.native)


def _calls_died_in(rank: int, table: Table, peers: Mapping[int, RankOutcome]) -> list[tuple[TableKey, int]]:
    """(group, seq) of every group of ``rank`` whose peers were broken off at a number the rank's own record
    has not reached."""
    out = []
    for key, seqs in table.items():
        if rank not in key[1] or len(key[1]) < 2:
            continue
        first = _broken_off(rank, seqs, peers)
        if first is not None and _behind(rank, seqs, first):
            out.append((key, first))
    return out


def unrecorded_call(o: RankOutcome, table: Table, peers: Mapping[int, RankOutcome] | None = None) -> Event | None:
    """The C++-issued call a crashed rank died in, when its stack shows it inside a functional collective
    and its record has not reached the number where its peers were broken off; None otherwise (or when the
    group is not clear). ``peers``: the other ranks' outcomes (how each one's run ended)."""
    last = o.last_event
    if o.state != RankState.CRASHED or (last is not None and not last.native and not _returned(last)):
        return None   # it died in a Python-issued call, written before it started: the record says which
    inside = _functional_in_stack(o.stack)
    if inside is None:
        return None
    found, line = inside
    candidates = _calls_died_in(o.rank, table, peers or {})
    if len(candidates) > 1 and last is not None:
        candidates = [c for c in candidates if c[0][0] == last.group]
    if len(candidates) != 1:
        return None
    (group, members), seq = candidates[0]
    t_enter = (last.t_exit or last.t_enter) if last else 0.0
    return Event(rank=o.rank, group=group, seq=seq, op=found.op or "?", t_enter=t_enter, group_ranks=members,
                 callsite=line or o.where, native=True, label=f"{found.api} ({UNRECORDED})")


def with_unrecorded_calls(outcomes: Mapping[int, RankOutcome], table: Table) -> dict[int, RankOutcome]:
    """The outcomes, each crashed rank's last call the one it died in where only its stack knew it."""
    out = dict(outcomes)
    for r, o in outcomes.items():
        e = unrecorded_call(o, table, outcomes)
        if e is not None:
            out[r] = dataclasses.replace(o, last_event=e, where=e.callsite or o.where)
    return out


def _reference(peers: Mapping[int, Event]) -> Event:
    """The peers' call as the report names it: the line most of them were sampled at (a peer whose sidecar
    sampled no user frame has none), the lowest rank among those."""
    lines = Counter(e.callsite for e in peers.values() if e.callsite)
    line = min(lines, key=lambda site: (-lines[site], site)) if lines else None
    return next(e for _, e in sorted(peers.items()) if e.callsite == line)


def _api(e: Event) -> str:
    return (e.label or e.op).removesuffix(f" ({UNRECORDED})")


def unrecorded_finding(inside: Event, receivers: Mapping[int, tuple[int, int]], peers: Mapping[int, Event],
                       words: str, text: str) -> Finding:
    """gloo aborted ``receivers`` (rank -> (bytes received, bytes expected)) while ``inside`` — a call
    only their stack knew — met the peers' calls at its (group, seq). The peers agree among themselves,
    so the rank out of step is the one alone in another call (by majority; two sides alike are a tie)."""
    calls = {r: e for r, e in peers.items()} | {inside.rank: inside}
    # Compared as the rules compare C++-issued calls: by what the backend runs. A peer's line and label come from
    # a stack its sidecar sampled a little later (none at all when it sampled no user frame), never compared.
    sigs: dict[int, tuple[object, ...]] = {r: (wire_op(e.op) if e.op != "?" else None, e.shapes, e.dtypes)
                                           for r, e in peers.items()}
    sigs[inside.rank] = (UNRECORDED,)   # only its stack knew the call: alone on its side by construction
    peer_sigs = {sigs[r] for r in peers}
    _, odd, tie = majority(sigs) if len(peer_sigs) == 1 else (None, [], True)
    ref = None if tie else _reference(peers)
    same_wire = ref is not None and (inside.op == "?" or wire_op(inside.op) == wire_op(ref.op))
    fields = ("shape",) if same_wire or ref is None else ("op", "shape")
    got = "; ".join(f"rank {r} received {a} bytes where it expected {b}" for r, (a, b) in sorted(receivers.items()))
    peer_side = ref or next(iter(peers.values()))
    peer_text = (f"{rank_list(peers)} called {peer_side.op} #{peer_side.seq} {who(peer_side)} "
                 f"(shape {field_value('shape', peer_side.shapes)})")
    mine = (f"{_api(inside)} on rank {inside.rank} at {site(inside.callsite)} issued "
            f"{'an ' + inside.op if inside.op != '?' else 'a collective'} from C++ as #{inside.seq} "
            f"(group {inside.group})")
    blame = (f"Rank {inside.rank} is out of step (its peers agree on their call)" if odd else
             "No side has a majority (a tie), so the records cannot say which side is out of step")
    summary = (f"{mine}, where {peer_text}. {blame}, and the buffers differ in size: gloo aborted "
               f"{rank_list(receivers)} ({got}: \"{words}\"). Call {_api(inside)} on every rank of its mesh, "
               f"or on none.")
    role = lambda r: "tie" if tie else ("odd" if r in odd else "majority")  # noqa: E731
    details = tuple(detail(r, role(r), e, note=("died inside it (gloo's size abort)" if r in receivers else None))
                    for r, e in sorted(calls.items()))
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group=inside.group, seq=inside.seq,
        op=ref.op if ref else inside.op, label=ref.label if ref else None,
        callsite=ref.callsite if ref else None, odd_ranks=tuple(odd), tie=tie, fields=fields,
        majority=ref.fingerprint() if ref else None, ranks=details, summary=summary,
        data={"backend_error": text, "unrecorded": {"rank": inside.rank, "api": _api(inside), "op": inside.op,
                                                    "callsite": inside.callsite},
              "receivers": {str(r): {"received": a, "expected": b} for r, (a, b) in receivers.items()},
              "values": {"shape": {"not recorded": [inside.rank],
                                   **{field_value("shape", e.shapes): [r]
                                      for r, e in sorted(peers.items()) if ref is None},
                                   **({field_value("shape", ref.shapes): sorted(peers)} if ref else {})}}},
    )
