"""all_to_all split sizes (``splits``): what rank i sends to rank j must be what
rank j expects from rank i. Each rank only knows its own side, so the check is
over the whole matrix of one call. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distcheck.diagnose.common import detail, who
from distcheck.models import Event, Finding, GroupKey, Kind, Severity
from distcheck.text import plural, rank_list

CONSEQUENCE = ("a rank receives more or fewer elements than it expects: gloo aborts the receiver, "
               "NCCL hangs or corrupts memory")
MAX_PAIRS_SHOWN = 6


@dataclass(frozen=True)
class Pair:
    """One broken pair: ``src`` sends ``sent`` elements to ``dst``, which expects ``expected``."""

    src: int
    dst: int
    sent: int
    expected: int


def broken_pairs(members: tuple[int, ...], events: Mapping[int, Event]) -> list[Pair]:
    """Every (sender, receiver) pair of one call whose sizes disagree; [] when a side recorded no splits."""
    if any(e.splits is None for e in events.values()):
        return []
    pairs = []
    for src, e in sorted(events.items()):
        order = e.group_ranks or members
        for dst, f in sorted(events.items()):
            theirs = f.group_ranks or members
            if src not in theirs or dst not in order:
                continue
            i, j = order.index(dst), theirs.index(src)
            sent, received = _sides(e)[0], _sides(f)[1]
            if i < len(sent) and j < len(received) and sent[i] != received[j]:
                pairs.append(Pair(src, dst, sent[i], received[j]))
    return pairs


def odd_side(pairs: Sequence[Pair], members: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """(odd ranks, tie): a rank is odd when it disagrees with most of its peers, its peers only with it.
    When that is every rank in a broken pair (two ranks, or sizes wrong everywhere) no side is blamed."""
    peers: dict[int, set[int]] = {}
    for p in pairs:
        peers.setdefault(p.src, set()).add(p.dst)
        peers.setdefault(p.dst, set()).add(p.src)
    others = max(len(members) - 1, 1)
    odd = tuple(sorted(r for r, ps in peers.items() if 2 * len(ps) > others))
    if not odd or set(odd) == set(peers):
        return (), True
    return odd, False


def splits_finding(group: GroupKey, seq: int, members: tuple[int, ...], events: Mapping[int, Event],
                   pairs: Sequence[Pair], odd: tuple[int, ...], tie: bool) -> Finding:
    role = lambda r: "tie" if tie else ("odd" if r in odd else "majority")  # noqa: E731
    details = tuple(detail(r, role(r), e, note=f"sends {_sizes(_sides(e)[0])}, expects {_sizes(_sides(e)[1])}")
                    for r, e in sorted(events.items()))
    ref = next((e for r, e in sorted(events.items()) if r not in odd), None) if not tie else None
    sample = events[min(events)]
    shown = "; ".join(f"rank {p.src} sends {plural(p.sent, 'element')} to rank {p.dst}, which expects {p.expected}"
                      for p in pairs[:MAX_PAIRS_SHOWN])
    more = f"; and {plural(len(pairs) - MAX_PAIRS_SHOWN, 'more pair')}" if len(pairs) > MAX_PAIRS_SHOWN else ""
    blame = (f"{rank_list(odd)} disagrees with most of its peers" if len(odd) == 1 else
             f"{rank_list(odd)} disagree with most of their peers") if odd else "no side has a majority (a tie)"
    summary = (f"{sample.op} #{seq} (group {group}): the split sizes do not match — {shown}{more}. "
               f"Rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]; {blame}. "
               f"Calls: " + "; ".join(f"rank {r} {who(e)}" for r, e in sorted(events.items()) if not odd or r in odd)
               + f". Exchange the sizes first (an all_to_all_single of the counts). Consequence: {CONSEQUENCE}.")
    return Finding(
        kind=Kind.MISMATCH, severity=Severity.ERROR, group=group, seq=seq, op=sample.op,
        label=ref.label if ref else sample.label, callsite=ref.callsite if ref else None,
        odd_ranks=odd, fields=("splits",), tie=tie, majority=ref.fingerprint() if ref else None,
        ranks=details, summary=summary,
        data={"pairs": [{"src": p.src, "dst": p.dst, "sent": p.sent, "expected": p.expected} for p in pairs],
              "splits": {str(r): {"send": list(_sides(e)[0]), "receive": list(_sides(e)[1])}
                         for r, e in sorted(events.items())}},
    )


def _sizes(sizes: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, sizes)) + "]"


def _sides(e: Event) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A call's splits (send, receive): only calls whose every side recorded them get here."""
    assert e.splits is not None
    return e.splits
