"""A C++-issued call a rank died in before its record had it. Pure.

DTensor's ``full_tensor()`` issues a functional all_gather from C++; the native sidecar records it
at its next poll. When gloo aborts the rank inside that call first (a peer's all_gather of another
size met it), the rank's record ends with the call before, which returned. Its stack at the abort
(faulthandler) still shows the functional collective and the API the user called
(``library_shapes.functional_call_in``), so the call is known: the group's next number, where the
peers' own calls wait. ``with_unrecorded_calls`` puts it in the rank's outcome, so every rule pairs
it with the peers' by (group, seq); ``unrecorded_finding`` is the mismatch gloo's abort then tells.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from distcheck.diagnose.common import GroupKey, Table, detail, majority, who
from distcheck.files.stacks import parse_dumps, user_top
from distcheck.knowledge.library_shapes import FunctionalCall, functional_call_in, wire_op
from distcheck.models import Event, Finding, RankOutcome, RankState
from distcheck.text import field_value, rank_list, site

UNRECORDED = "issued from C++, not yet recorded when the rank died"


def is_unrecorded(e: Event | None) -> bool:
    return e is not None and e.native and bool(e.label) and e.label.endswith(f"({UNRECORDED})")


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
                return found, (f"{top.file}:{top.line}:{top.function}" if top else None)
    return None


def _next_calls(rank: int, table: Table) -> list[tuple[GroupKey, int, dict[int, Event]]]:
    """(group, seq, the peers' events) of every group of ``rank`` whose peers are at a number past the
    rank's last one in it."""
    out = []
    for key, seqs in table.items():
        if rank not in key[1] or len(key[1]) < 2:
            continue
        mine = max((s for s, evs in seqs.items() if rank in evs), default=0)
        peers = {r: e for r, e in seqs.get(mine + 1, {}).items() if r != rank}
        if peers:
            out.append((key, mine + 1, peers))
    return out


def unrecorded_call(o: RankOutcome, table: Table) -> Event | None:
    """The C++-issued call a crashed rank died in, when its record ends with a call that returned and
    its stack shows it inside a functional collective; None otherwise (or when the group is not clear)."""
    last = o.last_event
    if o.state != RankState.CRASHED or (last is not None and (not last.completed or last.error)):
        return None
    inside = _functional_in_stack(o.stack)
    if inside is None:
        return None
    found, line = inside
    candidates = _next_calls(o.rank, table)
    if len(candidates) > 1 and last is not None:
        candidates = [c for c in candidates if c[0][0] == last.group]
    if len(candidates) != 1:
        return None
    (group, members), seq, _ = candidates[0]
    return Event(rank=o.rank, group=group, seq=seq, op=found.op or "?", t_enter=last.t_exit if last else 0.0,
                 group_ranks=members, callsite=o.where or line, native=True, label=f"{found.api} ({UNRECORDED})")


def with_unrecorded_calls(outcomes: Mapping[int, RankOutcome], table: Table) -> dict[int, RankOutcome]:
    """The outcomes, each crashed rank's last call the one it died in where only its stack knew it."""
    out = dict(outcomes)
    for r, o in outcomes.items():
        e = unrecorded_call(o, table)
        if e is not None:
            out[r] = dataclasses.replace(o, last_event=e)
    return out


def _api(e: Event) -> str:
    return (e.label or e.op).removesuffix(f" ({UNRECORDED})")


def unrecorded_finding(inside: Event, receivers: Mapping[int, tuple[int, int]], peers: Mapping[int, Event],
                       words: str, text: str) -> Finding:
    """gloo aborted ``receivers`` (rank -> (bytes received, bytes expected)) while ``inside`` — a call
    only their stack knew — met the peers' calls at its (group, seq). The peers agree among themselves,
    so the rank out of step is the one alone in another call (by majority; two sides alike are a tie)."""
    calls = {r: e for r, e in peers.items()} | {inside.rank: inside}
    sigs = {r: (wire_op(e.op) if e.op != "?" else None, e.callsite, e.shapes) for r, e in calls.items()}
    peer_sigs = {sigs[r] for r in peers}
    expected, odd, tie = majority(sigs) if len(peer_sigs) == 1 else (None, [], True)
    ref = None if tie else next(e for r, e in sorted(peers.items()) if sigs[r] == expected)
    same_wire = ref is not None and (inside.op == "?" or wire_op(inside.op) == wire_op(ref.op))
    fields = ("shape",) if same_wire or ref is None else ("op", "shape")
    got = "; ".join(f"rank {r} received {a} bytes where it expected {b}" for r, (a, b) in sorted(receivers.items()))
    peer_side = ref or next(iter(peers.values()))
    peer_text = (f"{rank_list(peers)} called {peer_side.op} #{peer_side.seq} {who(peer_side)} "
                 f"(shape {field_value('shape', peer_side.shapes)})")
    mine = (f"{_api(inside)} on rank {inside.rank} at {site(inside.callsite)} issued "
            f"{'an ' + inside.op if inside.op != '?' else 'a collective'} from C++ as #{inside.seq} (group {inside.group})")
    blame = (f"Rank {inside.rank} is out of step (its peers agree on their call)" if odd else
             "No side has a majority (a tie), so the records cannot say which side is out of step")
    summary = (f"{mine}, where {peer_text}. {blame}, and the buffers differ in size: gloo aborted "
               f"{rank_list(receivers)} ({got}: \"{words}\"). Call {_api(inside)} on every rank of its mesh, "
               f"or on none.")
    role = lambda r: "tie" if tie else ("odd" if r in odd else "majority")  # noqa: E731
    details = tuple(detail(r, role(r), e, note=("died inside it (gloo's size abort)" if r in receivers else None))
                    for r, e in sorted(calls.items()))
    return Finding(
        kind="mismatch", severity="error", group=inside.group, seq=inside.seq,
        op=ref.op if ref else inside.op, label=ref.label if ref else None,
        callsite=ref.callsite if ref else None, odd_ranks=tuple(odd), tie=tie, fields=fields,
        majority=ref.fingerprint() if ref else None, ranks=details, summary=summary,
        data={"backend_error": text, "unrecorded": {"rank": inside.rank, "api": _api(inside), "op": inside.op,
                                                    "callsite": inside.callsite},
              "receivers": {str(r): {"received": a, "expected": b} for r, (a, b) in receivers.items()},
              "values": {"shape": {"not recorded": [inside.rank],
                                   **{field_value("shape", e.shapes): [r] for r, e in sorted(peers.items()) if ref is None},
                                   **({field_value("shape", ref.shapes): sorted(peers)} if ref else {})}}},
    )
