"""attach's verdict in the terminal: ``distcheck run``'s view (``report.terminal``), except where nothing is
decided (ranks nobody could read, nothing found among the others). There the report's pass/fail says neither:
"NOT DECIDED" comes first and last, with the ranks not read (or blocked in a device sync in a call no Flight Recorder
dump names), and the run's PASS or FAIL line is not printed."""

from __future__ import annotations

from rich.console import Console, Group
from rich.text import Text

from distcheck.files.run_home import shown
from distcheck.models import Report, ScenarioResult
from distcheck.report import terminal
from distcheck.text import rank_list, short_path

NOT_DECIDED = "NOT DECIDED"


def render(report: Report, console: Console, verbose: bool, undecided: str | None) -> None:
    if undecided is None:
        terminal.render(report, console, verbose)
        return
    result = report.scenarios[0]
    console.print(Text.assemble(("  " + NOT_DECIDED + "  ", "bold yellow"), (result.source, "bold"),
                                f": {_unseen(result)}"))
    block = terminal.scenario_block(result, verbose=True)
    console.print(Group(*block.renderables[1:]))     # its findings (the not-decided one first) and rank table
    run = report.run
    console.print(Text.assemble((NOT_DECIDED, "bold yellow"), f"  {result.source}: {_unseen(result)}",
                                (f"  · {run.backend} × {run.world_size} ranks · {run.duration_s:.1f} s", "dim"),
                                (f"\n      run dir: {shown(short_path(run.run_dir))}", "dim")))


def _unseen(result: ScenarioResult) -> str:
    """"ranks 2, 3 not read": what the not-decided finding names, in a few words."""
    data = next((f.data for f in result.findings if f.data.get("not_decided")), {})
    said = [f"{rank_list(data['unread_ranks'])} not read"] if data.get("unread_ranks") else []
    if data.get("device_sync"):
        said.append(f"{rank_list(sorted(map(int, data['device_sync'])))} blocked in a device sync, in a call "
                    "no Flight Recorder dump names")
    said += [f"the stacks of {rank_list(data['unreadable_ranks'])} unreadable"] if data.get("unreadable_ranks") else []
    return ", ".join(said) or "not every rank was read"
