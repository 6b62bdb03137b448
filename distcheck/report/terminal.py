"""Terminal renderer: one merged view per scenario, never N ranks of log spam.

It formats findings; it never decides what a hang or a mismatch is.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from distcheck.models import EndReason, Finding, RankOutcome, Report, ScenarioResult
from distcheck.report.frames import without_own_frames
from distcheck.report.health_table import bandwidth_table, is_bandwidth_table
from distcheck.report.words import ending as _ending
from distcheck.report.words import alike_ranks, script_name, script_observed
from distcheck.text import plural, rank_list, short_path
from distcheck.torch_features import describe

KIND_STYLE = {
    "hang": "bold red", "crash": "bold red", "mismatch": "bold magenta", "order": "bold magenta",
    "count": "magenta", "numeric": "bold yellow", "duplicates": "bold yellow", "straggler": "yellow",
}


def _script_line(result: ScenarioResult, mark: tuple[str, str]) -> Text:
    """A script declares no expectation: say what it showed ("train.py: hang")."""
    return Text.assemble(mark, (result.test or script_name(result), "bold"), ": ",
                         (script_observed(result), "green" if result.ok else "red"),
                         (_ending(result), "dim" if result.ok else "red"), (f"  ({result.duration_s:.1f} s)", "dim"))


def scenario_line(result: ScenarioResult) -> Text:
    if result.skipped:
        return Text.assemble(("  SKIP ", "dim"), (result.name, "bold"), (f"  {result.skipped}", "dim"))
    mark = ("  OK   ", "bold green") if result.ok else ("  FAIL ", "bold red")
    if result.script:
        line = _script_line(result, mark)
    else:
        line = Text.assemble(
            mark, (result.name, "bold"), f"  expected {'+'.join(result.expected)}, observed ",
            ("+".join(result.observed), "green" if result.ok else "red"),
            (_ending(result), "dim" if result.ok else "red"), (f"  ({result.duration_s:.1f} s)", "dim"),
        )
    return line


def clean_line(result: ScenarioResult) -> Text | None:
    """What a clean result checked ("clean: 1,204 collectives on 4 ranks matched, no stall")."""
    if result.observed != ("pass",) or not result.collectives_compared:
        return None
    window = " in the --max-duration window" if result.end_reason == "max_duration" else ""
    return Text(f"         clean{window}: {result.collectives_compared:,} collectives on "
                f"{len(result.ranks)} ranks matched, no stall", style="green")


def _rank_table(ranks: tuple[RankOutcome, ...]) -> Table:
    table = Table(show_header=True, header_style="dim", box=None, padding=(0, 2), pad_edge=False)
    table.add_column("rank", justify="right")
    table.add_column("state")
    table.add_column("collectives", justify="right")
    table.add_column("where")
    for label, (state, collectives, where) in alike_ranks((r.rank, _rank_row(r)) for r in ranks):
        table.add_row(label, state, collectives, escape(where))
    return table


def _rank_row(r: RankOutcome) -> tuple[str, str, str]:
    where = r.exception or (f"killed by {r.signal}" if r.state == "crashed" and r.signal else "")
    if r.where:
        where = f"{where} at {short_path(r.where)}" if where else short_path(r.where)
    if r.state == "stuck" and r.last_event is not None:
        e = r.last_event
        where = f"{e.op} #{e.seq} [{e.label or '-'}] {short_path(e.callsite)}"
    if r.flight_recorder:
        where = f"{where}  {flight_recorder_text(r.flight_recorder)}".strip()
    return r.state, f"{r.collectives:,}", where or "-"


def flight_recorder_text(status: dict[str, dict[str, int]]) -> str:
    """'FR[group 0]: enqueued #5, started -, completed #4' — the GPU-side truth on NCCL."""
    def seq(n: int | None) -> str:
        return "-" if n is None or n < 0 else f"#{n}"

    parts = []
    for group, s in sorted(status.items()):
        if s:
            parts.append(f"FR[group {group}]: enqueued {seq(s.get('last_enqueued_collective'))}, "
                         f"started {seq(s.get('last_started_collective'))}, "
                         f"completed {seq(s.get('last_completed_collective'))}")
    return "; ".join(parts)


def finding_block(finding: Finding, expected: bool = False) -> Group:
    """A finding; one the scenario expected (a demonstration found as it should be) says "expected",
    never its severity, so a passing run shows no error line."""
    label = "expected" if expected else finding.severity
    parts = [Text.assemble(("    ", ""), (f"{finding.kind.upper()}", "green" if expected else KIND_STYLE.get(finding.kind, "bold")),
                           (f" [{label}] ", "dim"), finding.summary)]
    # One line per distinct call (role, op, label, line), not one per rank: readable at 1000 ranks.
    calls: dict[tuple, list[int]] = {}
    for d in finding.ranks:
        if finding.kind in ("mismatch", "order", "count") and d.callsite:
            calls.setdefault((d.role, d.op, d.seq, d.label, d.callsite), []).append(d.rank)
    for (role, op, seq, label, callsite), ranks in calls.items():
        parts.append(Text(f"        {rank_list(ranks)} ({role}): {op} #{seq} "
                          f"{label or '-'} at {short_path(callsite)}", style="dim"))
    if finding.detected_after_s is not None:
        parts.append(Text(f"        detected {finding.detected_after_s:.1f} s after the last progress", style="dim"))
    return Group(*parts)


def scenario_table(table: dict) -> Table:
    """A table the scenario reported (e.g. bus bandwidth per size), as nccl-tests prints it."""
    if is_bandwidth_table(table):
        return bandwidth_table(table)
    out = Table(title=table["title"], title_justify="left", box=None, padding=(0, 2), header_style="dim")
    for column in table["columns"]:
        out.add_column(column, justify="left" if column in ("op", "result") else "right")
    for row in table["rows"]:
        out.add_row(*(escape(str(v)) for v in row))
    return out


def is_expected(result: ScenarioResult, finding: Finding) -> bool:
    """A finding the scenario declared, in a result that behaved as declared."""
    return result.ok and not result.script and finding.kind in result.expected


def scenario_block(result: ScenarioResult, verbose: bool = False) -> Group:
    """pytest's levels: a result as expected is its one line; one that is not, or ``verbose`` (and a run of
    one target: callers pass it), also its tables, findings (expected ones marked so) and rank table."""
    parts: list = [scenario_line(result)]
    if result.skipped:
        return Group(*parts)
    clean = clean_line(result) if result.script or verbose else None
    if clean is not None:   # a script's one verdict says what it checked; scenarios' at -v
        parts.append(clean)
    if verbose or not result.ok:
        parts.extend(scenario_table(t) for t in result.tables)
    if result.ok and not verbose:
        return Group(*parts)
    for finding in result.findings:
        parts.append(finding_block(finding, is_expected(result, finding)))
    if result.ranks and (result.findings or verbose or not result.ok):
        parts.append(_rank_table(result.ranks))
    tail = without_own_frames(result.log_tail or "").splitlines()[-12:]
    if not result.ok and tail:
        parts.append(Text("    log tail (distcheck's own frames left out; every line in the run dir's logs):",
                          style="dim"))
        parts.append(Text("\n".join("      " + line for line in tail), style="dim"))
    return Group(*parts)


def summary_line(report: Report, verbose: bool = False, quiet: bool = False) -> Text:
    """The run's verdict, then (not ``quiet``) what needs the user's attention and where the run dir is;
    ``verbose`` adds the torch line (what the installed torch offers; ``distcheck env`` has it too)."""
    ran = [s for s in report.scenarios if not s.skipped]
    verdict = ("PASS", "bold green") if report.verdict == "pass" else ("FAIL", "bold red")
    if report.nothing_ran:
        verdict = ("NOTHING RAN", "bold yellow")
    # How the whole run ended, where that is not each line's own story: a person or a limit cut it short.
    ended = report.end_reason
    extra = f" ({ended.words})" if ended.interrupted or ended in (EndReason.TIMEOUT, EndReason.MAX_DURATION) else ""
    counts = _counts(ran)
    skipped = len(report.scenarios) - len(ran)
    line = Text.assemble(
        "" if quiet else command_output(report), verdict, counts, f", {skipped} skipped" if skipped else "",
        "" if extra and counts.endswith(extra) else extra,   # a script's own line already says it
        (f"  · {report.run.backend} × {report.run.world_size} ranks · {report.run.duration_s:.1f} s", "dim"))
    if quiet:
        return line
    if attention := attention_line(report):
        line.append(f"\n      {attention}", style="bold")
    line.append(f"\n      run dir: {short_path(report.run.run_dir)}", style="dim")
    if verbose and (torch_line := describe(report.run.torch_version, report.run.torch_features)):
        line.append(f"\n      {torch_line}", style="dim")
    return line


def _counts(ran: list[ScenarioResult]) -> str:
    tests = [s for s in ran if s.test]
    if tests:
        clean = sum(1 for s in tests if s.ok)
        rest = [s for s in ran if not s.test]
        return f"  {clean}/{len(tests)} tests' ranks ran clean" + "".join(f"; {_shown(s)}" for s in rest)
    if ran and all(s.script for s in ran):
        return "  " + "; ".join(_shown(s) for s in ran)
    ok = [s for s in ran if s.ok]
    found = sum(1 for s in ok if s.expected != ("pass",))
    kinds = f" ({plural(found, 'planted bug')} found, {len(ok) - found} clean)" if found else ""
    return f"  {len(ok)}/{len(ran)} scenarios behaved as expected{kinds}"


def attention_line(report: Report) -> str:
    """One line naming what needs the user's attention: the targets that did not behave as expected
    (a script that found something), and why nothing ran. Empty for a clean pass."""
    failed = [s for s in report.scenarios if not s.skipped and not s.ok]
    if report.nothing_ran:
        reasons = sorted({s.skipped or "" for s in report.scenarios})
        return "needs attention: every target was skipped: " + "; ".join(reasons)
    if not failed:
        return ""
    named = [f"{s.test or (script_name(s) if s.script else s.name)}"
             + ("" if s.script else f" ({'+'.join(s.expected)} expected, {'+'.join(s.observed)} observed)")
             for s in failed]
    shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
    return f"needs attention: {shown} (details above)"


def _shown(result: ScenarioResult) -> str:
    """A script's or command's verdict in the summary line ("train.py: ran clean")."""
    return f"{script_name(result)}: {script_observed(result)}{_ending(result)}"


def command_output(report: Report) -> Text:
    """``run -- CMD``: the command's own last lines (pytest's "16 passed"), right above the verdict."""
    lines = (report.run.command_output or "").splitlines()[-6:]
    if not lines:
        return Text("")
    body = "\n".join("      " + line[:200] for line in lines)
    return Text.assemble(("    the command's last output:\n", "dim"), (body + "\n", "dim"))


def render(report: Report, console: Console, verbose: bool = False, quiet: bool = False) -> None:
    if not quiet:
        single = len(report.scenarios) == 1   # a run of one target: all there is to say about it
        for result in report.scenarios:
            console.print(scenario_block(result, verbose or single))
    console.print(summary_line(report, verbose, quiet), soft_wrap=quiet)
