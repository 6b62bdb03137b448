"""Blame by majority, for a post-mortem: which side of a hang is the odd one out,
and which ranks cannot be judged because their dump is missing or cut short. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from distcheck.models import Finding, Kind, RankDetail
from distcheck.text import rank_list


def attribute_by_majority(findings: list[Finding], missing: Sequence[int] = (),
                          cut_short: Sequence[int] = ()) -> list[Finding]:
    """Name the odd side of each hang by majority, and say which ranks cannot be judged.

    The analysis lists who waits and who never came; this adds which side is the
    odd one out (the smaller), never "whichever file was read first". A tie is
    stated as a tie. ``missing`` ranks left no dump, ``cut_short`` ones a partial
    one: they are neither side.
    """
    out = []
    for f in findings:
        if f.kind is not Kind.HANG or not f.waiting_ranks or not f.absent_ranks or f.odd_ranks:
            out.append(_with_unknown(f, missing, cut_short))
            continue
        waiting, absent = f.waiting_ranks, f.absent_ranks
        total = len(waiting) + len(absent)
        what = f"{f.op} #{f.seq}" + (f" (group {f.group})" if f.group else "")
        if len(waiting) == len(absent):
            sentence = (f"No majority: {len(waiting)} of {total} ranks entered {what} and {len(absent)} never did, "
                        f"so neither side can be called the odd one out.")
            f = dataclasses.replace(f, tie=True, summary=f"{f.summary} {sentence}")
        else:
            odd = waiting if len(waiting) < len(absent) else absent
            rest = total - len(odd)
            verb = "is" if len(odd) == 1 else "are"
            if odd is waiting:
                sentence = (f"By majority, {rank_list(odd)} {verb} the odd one out: {rest} of {total} ranks "
                            f"never called {what}.")
            else:
                sentence = (f"By majority, {rank_list(odd)} {verb} the odd one out: {rest} of {total} ranks "
                            f"are waiting in {what}, which {rank_list(odd)} never entered.")
            f = dataclasses.replace(f, odd_ranks=tuple(odd), summary=f"{f.summary} {sentence}")
        out.append(_with_unknown(f, missing, cut_short))
    return out


def _with_unknown(f: Finding, missing: Sequence[int], cut_short: Sequence[int]) -> Finding:
    if f.kind is not Kind.HANG or f.op is None or not (missing or cut_short):
        return f
    extra = tuple(RankDetail(rank=r, role="no dump", note="left no dump") for r in missing)
    extra += tuple(RankDetail(rank=r, role="cut short", note="dump cut short") for r in cut_short)
    parts = []
    if missing:
        parts.append(f"{rank_list(missing)} left no dump")
    if cut_short:
        parts.append(f"{rank_list(cut_short)} left a dump that is cut short")
    unknown = [*missing, *cut_short]
    sentence = (f"{' and '.join(parts)}, so whether {'it' if len(unknown) == 1 else 'they'} entered it "
                f"cannot be told.")
    return dataclasses.replace(f, ranks=f.ranks + extra, summary=f"{f.summary} {sentence[0].upper()}{sentence[1:]}")
