"""Ranks stopped in different calls, as read from outside. Pure.

``distcheck attach`` without the Flight Recorder sees each rank's stack, not its calls' groups or numbers: every
rank waiting in a collective is taken to wait in "the call open now". Where their stacks stand at different calls
(a TP group's all_reduce at one line, the DP groups' all-gathers and the pipeline's receives downstream of it at
others), those are not one call whose ranks disagree: nothing says they are in the same group, so no mismatch is
claimed. What is said is what was seen: which ranks stand where, and the fewest of them first, since a call of a
small group that stalls leaves everyone else waiting downstream of it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from distcheck.diagnose.common import Table
from distcheck.models import Event
from distcheck.text import id_list, rank_list, site

STANDS_OUT = 4   # the fewest ranks are pointed at when the next call holds at least this many times as many
SHOWN_RUNS = 6   # of a side's ranks, in the sentence (the finding's data holds them all)
FR_HINT = ("the Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE, dumped where the job enabled it) joins the ranks' calls "
           "by group and number")


def calls_apart(events: Mapping[int, Event]) -> list[list[int]] | None:
    """The ranks of each call their stacks stand at (op and line), the fewest first, where there are several;
    None where every rank stands at one."""
    at: dict[tuple[str, str | None], list[int]] = defaultdict(list)
    for rank, e in sorted(events.items()):
        at[(e.op, e.callsite)].append(rank)
    if len(at) < 2:
        return None
    return sorted(at.values(), key=lambda ranks: (len(ranks), ranks[0]))


def without_apart(table: Table) -> Table:
    """The calls whose ranks stand at one call: the others hold no fingerprints to compare (read from outside)."""
    return {key: {seq: events for seq, events in seqs.items() if calls_apart(events) is None}
            for key, seqs in table.items()}


def apart_summary(events: Mapping[int, Event], sides: list[list[int]]) -> str:
    """"32 ranks stand in 2 different calls …": each call's ranks, and the fewest named as where to look first."""
    where = "; ".join(f"{_ranks(ranks)} in {call_words(events[ranks[0]])}" for ranks in sides)
    said = (f"{len(events):,} ranks stand in {len(sides)} different collectives and none moved: {where}. Read from "
            f"outside, without groups or sequence numbers, which call waits on which is not known")
    fewest = sides[0]
    if len(fewest) * STANDS_OUT > len(sides[1]):   # no call stands out by its few ranks (a pipeline's sides)
        return f"{said}: {FR_HINT}."
    return (f"{said}; the fewest, {rank_list(fewest)}, {'is' if len(fewest) == 1 else 'are'} in "
            f"{call_words(events[fewest[0]])}: where one small group's call stalls, the others wait downstream of it. "
            f"Look there first; {FR_HINT}.")


def _ranks(ranks: list[int]) -> str:
    """A side's ranks, in one line however many: at 4,096 ranks of a mesh a side is hundreds of runs."""
    text = rank_list(ranks)
    return text if text.count(",") < SHOWN_RUNS else f"{len(ranks):,} ranks ({id_list(ranks, limit=SHOWN_RUNS)})"


def call_words(e: Event) -> str:
    """"all_reduce at train.py:140": a call read from outside, by its op and line."""
    called = f"called from {e.label} at {site(e.callsite)}" if e.label else f"at {site(e.callsite)}"
    return f"{e.op} {called}"
