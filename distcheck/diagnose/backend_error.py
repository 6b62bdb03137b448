"""The backend's own words as evidence (``bytes``): gloo aborts a rank that
receives more bytes than it expects ("Received data size doesn't match expected
size ... 388 vs 4"). When no recorded fingerprint explains such an abort, this
turns the message into a mismatch: who received how many bytes against how many
expected, in which call, and which sender (by majority), never the receiver. Pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distcheck.diagnose.common import call, detail
from distcheck.diagnose.unrecorded import is_unrecorded, unrecorded_finding
from distcheck.models import Event, Finding, GroupKey, Kind, RankDetail, RankOutcome, Severity
from distcheck.text import rank_list, site

SIZE_TEXT = "Received data size doesn't match expected size"
# The same abort in the gloo of torch < 2.8 (measured on 2.6.0): "[enforce fail at
# .../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 388 vs 4" (received vs expected).
OLD_SIZE_TEXT = "op.preamble.length <= op.nbytes"
SIZE_TEXTS = (SIZE_TEXT, OLD_SIZE_TEXT)
_SIZES = re.compile(r"(\d+) vs (\d+)")
_ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_TERMINATE = re.compile(r"what\(\):\s*(.*)")


# NCCL's watchdog ends a process whose collective outlived the group's timeout, or failed (a peer died, the
# communicator was aborted): a reaction, evidence of which call the rank waited in, never the root cause while a
# peer that never came explains it. "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8,
# OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600123 milliseconds before timing out."
NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
                          r"(?:.*?Timeout\(ms\)=(\d+))?")
NCCL_REACTIONS = ("Watchdog caught collective operation timeout", "Operation timed out after",   # nccl2's words
                  "NCCL communicator was aborted", "ncclRemoteError", "remote process exited",
                  "Process group watchdog thread terminated with exception")


@dataclass(frozen=True)
class WatchdogAbort:
    """NCCL's watchdog's end of a rank: the call (by its sequence number on the group) it timed out in."""

    seq: int | None
    op: str | None
    timeout_s: float | None


def watchdog_abort(text: str | None) -> WatchdogAbort | None:
    """NCCL's watchdog's abort (its time-out or an async error) in a rank's last words; None when it is not one."""
    if not text or not any(words in text for words in NCCL_REACTIONS):
        return None
    m = NCCL_TIMEOUT.search(text)
    if m is None:
        return WatchdogAbort(None, None, None)
    return WatchdogAbort(int(m.group(1)), m.group(2).lower(), int(m.group(3)) / 1000 if m.group(3) else None)


def abort_text(log: str) -> str | None:
    """The ``what():`` of a C++ exception that terminated the process (a SIGABRT), from its log."""
    lines = log.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _TERMINATE.search(lines[i])
        if m:
            rest = [m.group(1)] + [ln.strip() for ln in lines[i + 1:i + 4] if ln.strip()]
            return " ".join(rest)[:600]
    return None


@dataclass(frozen=True)
class SizeAbort:
    rank: int
    received: int      # bytes that arrived
    expected: int      # bytes the receiving buffer holds
    text: str
    words: str = SIZE_TEXT   # gloo's phrase for it (this torch's)


def size_abort(o: RankOutcome) -> SizeAbort | None:
    text = o.exception or ""
    words = next((w for w in SIZE_TEXTS if w in text), None)
    if words is None:
        return None
    m = _SIZES.search(text)
    return SizeAbort(o.rank, int(m.group(1)), int(m.group(2)), text, words) if m else None


def nbytes(e: Event) -> int | None:
    """Bytes of a call's one buffer, when its record says (one tensor of a known dtype)."""
    if len(e.shapes) != 1 or len(e.dtypes) != 1 or e.dtypes[0] not in _ITEM_BYTES:
        return None
    return math.prod(e.shapes[0]) * _ITEM_BYTES[e.dtypes[0]]


def find_backend_mismatches(outcomes: Mapping[int, RankOutcome],
                            traces: Mapping[int, Sequence[Event]]) -> list[Finding]:
    """One finding per call whose receivers gloo aborted for a size (the linking pass, ``diagnose.causes``, keeps
    those no fingerprint mismatch in the same call explains)."""
    aborts = [a for a in (size_abort(o) for _, o in sorted(outcomes.items())) if a]
    by_call: dict[tuple[str, int], list[tuple[SizeAbort, Event | None]]] = {}
    for a in aborts:
        e = outcomes[a.rank].last_event
        by_call.setdefault((e.group, e.seq) if e else ("?", 0), []).append((a, e))
    return [_finding(found, traces) for found in by_call.values()]


def _senders(receivers: Sequence[int], inside: Event | None, traces: Mapping[int, Sequence[Event]]) -> dict[int, Event]:
    """Who could have sent it: the other members of the same call, or ranks that sent to the receiver."""
    out: dict[int, Event] = {}
    for r, events in traces.items():
        if r in receivers:
            continue
        for e in reversed(events):
            same_call = inside is not None and not inside.is_p2p and (e.group, e.seq) == (inside.group, inside.seq)
            to_receiver = e.is_p2p and e.root in receivers and GroupKey.of(e.group).dst == e.root
            if same_call or (inside is not None and inside.is_p2p and to_receiver):
                out[r] = e
                break
    return out


def _blame(senders: Mapping[int, Event], received: int, receivers: Sequence[int],
           collective: bool) -> tuple[tuple[int, ...], bool]:
    """(odd senders, tie). The senders whose buffer has the size that arrived, when they are the smaller
    side (or the only sender); else, in a collective, the ranks that did not abort when the receivers that
    did are the majority; else nobody: a tie, never the receiver."""
    sized = tuple(sorted(r for r, e in senders.items() if nbytes(e) == received))
    if sized and (len(senders) == 1 or 2 * len(sized) < len(senders)):
        return sized, False
    if not sized and collective and senders and len(senders) < len(receivers):
        return tuple(sorted(senders)), False
    return (), True


def _finding(found: list[tuple[SizeAbort, Event | None]], traces: Mapping[int, Sequence[Event]]) -> Finding:
    receivers = [a.rank for a, _ in found]
    a, inside = found[0]
    senders = _senders(receivers, inside, traces)
    if is_unrecorded(inside):   # a C++-issued call only the aborted rank's stack knew (diagnose.unrecorded)
        return unrecorded_finding(inside, {x.rank: (x.received, x.expected) for x, _ in found}, senders, a.words,
                                  a.text)
    odd, tie = _blame(senders, a.received, receivers, inside is not None and not inside.is_p2p)
    where = f"inside {call(inside)} at {site(inside.callsite)}" if inside else "outside any recorded call"
    got = "; ".join(f"rank {x.rank} received {x.received} bytes where it expected {x.expected}" for x, _ in found)
    blame = (f"By the sizes, the sender is {rank_list(odd)} ({rank_list(senders)} could have sent it)" if odd
             else f"The sender cannot be told from the records ({rank_list(senders) if senders else 'no rank'} "
                  f"could have sent it); the receiver that aborted is not the cause")
    summary = (f"gloo aborted {rank_list(receivers)} {where}: {got} (\"{a.words}\"). The recorded fingerprints "
               f"do not explain it (e.g. a receive from any source, or a call issued outside the tracer). "
               f"{blame}. The sender's buffer and the receiver's must have the same size.")
    details = [detail(r, "receiver", e, note=f"received {x.received} bytes, expected {x.expected}")
               for x, e in found for r in [x.rank]]
    details += [detail(r, "sender" if r in odd else "peer", e,
                       note=f"buffer of {nbytes(e)} bytes" if nbytes(e) else None)
                for r, e in sorted(senders.items())]
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR,
        group=inside.group if inside else None, seq=inside.seq if inside else None,
        op=inside.op if inside else None, label=inside.label if inside else None,
        callsite=inside.callsite if inside else None, odd_ranks=odd, tie=tie, fields=("bytes",),
        ranks=tuple(details) if details else (RankDetail(rank=a.rank, role="receiver"),), summary=summary,
        data={"backend_error": a.text, "receivers": {str(x.rank): {"received": x.received, "expected": x.expected}
                                                   for x, _ in found},
              "values": {"bytes": {str(x.received): [x.rank] for x, _ in found}}},
    )
