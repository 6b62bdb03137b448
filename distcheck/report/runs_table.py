"""Terminal view of ``distcheck runs``: recent saved runs, newest first."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from distcheck.models import EndReason, RunSummary

VERDICT_STYLE = {"pass": "bold green", "fail": "bold red", "incomplete": "yellow", "corrupt": "bold yellow"}


def table(runs: Sequence[RunSummary]) -> Table:
    t = Table(show_header=True, header_style="dim", box=None, padding=(0, 2), pad_edge=False)
    t.add_column("id", no_wrap=True)
    t.add_column("time", no_wrap=True)
    t.add_column("verdict")
    t.add_column("ended")
    t.add_column("scenarios")
    t.add_column("backend × ranks", no_wrap=True)
    for r in runs:
        if r.problem:
            t.add_row(escape(r.id), r.started_at or "-", Text(r.verdict, VERDICT_STYLE.get(r.verdict, "")), "-",
                      Text(r.problem, style="dim"), "-")
            continue
        names = ", ".join(r.names[:3]) + (f", +{len(r.names) - 3}" if len(r.names) > 3 else "")
        counts = f"{r.ok}/{r.scenarios - r.skipped} ok" + (f", {r.skipped} skipped" if r.skipped else "")
        t.add_row(escape(r.id), (r.started_at or "-").replace("T", " "),
                  Text(r.verdict.upper(), VERDICT_STYLE.get(r.verdict, "")), ended(r),
                  escape(f"{counts}: {names}"), f"{r.backend} × {r.world_size}")
    return t


def ended(run: RunSummary) -> str:
    """How the run ended, in ``EndReason.words`` as the terminal and JUnit say it."""
    return EndReason.of(run.end_reason).words if run.end_reason else "-"


def render(runs: Sequence[RunSummary], console: Console, root: str) -> None:
    if not runs:
        console.print(f"no saved runs under {root}", style="dim", markup=False)
        return
    console.print(table(runs))
