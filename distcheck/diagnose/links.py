"""The slow link of a node: from the pairwise send/recv matrix, the rank or ordered pair clearly below
the others. Pure.

A rank is slow *to send* when the median bandwidth of its sends is below ``ratio`` × the median of the
other ranks' send medians (and likewise *to receive*): one slow GPU, NIC or PCIe link shows up on
every pair it is part of in that direction, while the others' medians stay on the healthy value. An
ordered pair is slow when it is below ``ratio`` × the median of all pairs and neither of its ranks
already explains it.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

SLOW_RATIO = 0.7


class LinkKind(str, enum.Enum):
    """What is slow: a rank's every link one way, or one ordered pair."""

    SEND = "send"
    RECV = "recv"
    PAIR = "pair"


@dataclass(frozen=True)
class SlowLink:
    kind: LinkKind             # SEND / RECV: a rank's every link that way; PAIR: one ordered pair
    ranks: tuple[int, ...]     # the rank, or (sender, receiver)
    gbps: float                # its (median) bandwidth
    reference_gbps: float      # what it is compared with
    ratio: float = SLOW_RATIO  # "clearly below": under ratio × the reference

    def describe(self) -> str:
        if self.kind is LinkKind.PAIR:
            src, dst = self.ranks
            return (f"send/recv {src}->{dst} runs at {self.gbps:.3g} GB/s, below {self.ratio:g}× the median "
                    f"pair ({self.reference_gbps:.3g} GB/s)")
        verb = "sends" if self.kind is LinkKind.SEND else "receives"
        return (f"rank {self.ranks[0]} {verb} at {self.gbps:.3g} GB/s (median over its peers), below "
                f"{self.ratio:g}× the other ranks' median ({self.reference_gbps:.3g} GB/s)")


def slow_links(matrix: Mapping[tuple[int, int], float], ratio: float = SLOW_RATIO) -> list[SlowLink]:
    """The slow ranks (by direction) and slow pairs of ``matrix`` ((sender, receiver) → GB/s), slowest first."""
    ranks = sorted({r for pair in matrix for r in pair})
    found = []
    for kind, side in ((LinkKind.SEND, 0), (LinkKind.RECV, 1)):
        medians = {r: statistics.median(v for p, v in matrix.items() if p[side] == r) for r in ranks
                   if any(p[side] == r for p in matrix)}
        for r, value in medians.items():
            others = [m for q, m in medians.items() if q != r]
            if len(others) >= 2 and value < ratio * statistics.median(others):
                found.append(SlowLink(kind, (r,), value, statistics.median(others), ratio))
    explained = {(link.kind, link.ranks[0]) for link in found}
    if len(matrix) >= 3:
        typical = statistics.median(matrix.values())
        for (src, dst), value in matrix.items():
            if (value < ratio * typical and (LinkKind.SEND, src) not in explained
                    and (LinkKind.RECV, dst) not in explained):
                found.append(SlowLink(LinkKind.PAIR, (src, dst), value, typical, ratio))
    return sorted(found, key=lambda link: link.gbps / link.reference_gbps)
