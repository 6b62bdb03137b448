"""How a result is stated in words, the same in every view (terminal, JUnit, ``distcheck runs``):
a scenario against its expectation, a script as a script, and how its launch ended
(``EndReason.words``). Pure text."""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable
from typing import TypeVar

from distcheck.models import PASS, EndReason, Finding, Kind, ScenarioResult, Severity
from distcheck.text import id_list, rank_list, site


def script_name(result: ScenarioResult) -> str:
    """How a script is named to its user: the file they gave ("train.py"), else "-m module" or the command."""
    plain_file = result.source.endswith(".py") and " " not in result.source
    return result.source.rsplit("/", 1)[-1] if plain_file else result.source


def script_observed(result: ScenarioResult) -> str:
    """What a script showed: "ran clean" only when it ran to its end (or through the pre-flight window)."""
    if result.observed != (PASS,):
        return "+".join(result.observed)
    ended = EndReason.of(result.end_reason)
    return "ran clean" if ended in (EndReason.COMPLETED, EndReason.MAX_DURATION) else ended.words


def ending(result: ScenarioResult) -> str:
    """How the launch ended, wherever it did not simply complete: " (ended at a certain hang)",
    " (ended by --timeout)", " (interrupted)"; empty for a completed launch and a crash (the finding itself)."""
    ended = EndReason.of(result.end_reason)
    if ended in (EndReason.COMPLETED, EndReason.CRASH) or (result.script and script_observed(result) == ended.words):
        return ""
    return f" ({ended.words})"


# gloo's source location ("[/__w/pytorch/.../pair.cc:553] ") and its advice after the facts
_SOURCE_AT = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")
_ADVICE = (". This is typically caused", " This is typically caused", ". Check the logs")


def error_words(exception: str) -> str:
    """An exception's first line as a table row says it: a backend's source location and advice left out
    ("RuntimeError: Connection closed by peer [127.0.0.1]:22193")."""
    text = _SOURCE_AT.sub("", exception.strip().splitlines()[0] if exception.strip() else "")
    for advice in _ADVICE:
        text = text.split(advice)[0]
    return text


def verdict(result: ScenarioResult) -> str:
    """One line: "train.py: hang (ended at a certain hang)" for a script (it declared no expectation),
    "expected hang, observed hang (ended at a certain hang)" for a scenario."""
    if result.skipped:
        return f"skipped: {result.skipped}"
    if result.script:
        return f"{result.test or script_name(result)}: {script_observed(result)}{ending(result)}"
    observed = "+".join(result.observed) or PASS
    return f"expected {'+'.join(result.expected) or 'pass'}, observed {observed}{ending(result)}"


def headline(result: ScenarioResult) -> str:
    """The diagnosis in one line, for a place that shows one (pytest's FAILED line): "hang: rank 0 in barrier
    at test_x.py:19; rank 1 never entered"; the verdict where no finding says more."""
    errors = [f for f in result.findings if f.severity is Severity.ERROR] or list(result.findings)
    return finding_headline(errors[0]) if errors else verdict(result)


def finding_headline(finding: Finding) -> str:
    """One finding in one line: who, in which call, where."""
    call = f"{finding.op or 'a collective'} at {site(finding.callsite)}"
    if finding.kind is Kind.HANG and finding.waiting_ranks:
        absent = f"; {rank_list(finding.absent_ranks)} never entered" if finding.absent_ranks else ""
        return f"hang: {rank_list(finding.waiting_ranks)} in {call}{absent}"
    if finding.odd_ranks:
        return f"{finding.kind}: {rank_list(finding.odd_ranks)} out of line in {call}"
    first = finding.summary.split(". ")[0].rstrip(".")
    return f"{finding.kind}: {first}"


EACH_RANK_UP_TO = 48    # past this many ranks, ranks whose lines read alike share one line
_LABEL_RUNS = 8         # a shared line names at most this many runs of its ranks, then its count


Row = TypeVar("Row", bound=Hashable)   # a per-rank table's row


def alike_ranks(rows: Iterable[tuple[int, Row]], each_up_to: int = EACH_RANK_UP_TO) -> list[tuple[str, Row]]:
    """(ranks' label, row) of a per-rank table: every rank its own line up to ``each_up_to`` ranks; past
    that, ranks whose rows are equal share one line, labelled "0-4090, 4092-4095 (4,095)", in the order
    of their first rank. 4,096 lines of "stuck in barrier #5001" are read as one."""
    listed = list(rows)
    if len(listed) <= each_up_to:
        return [(str(rank), row) for rank, row in listed]
    alike: dict[Row, list[int]] = {}
    for rank, row in listed:
        alike.setdefault(row, []).append(rank)
    return [(str(ranks[0]) if len(ranks) == 1 else f"{id_list(ranks, limit=_LABEL_RUNS)} ({len(ranks):,})", row)
            for row, ranks in alike.items()]
