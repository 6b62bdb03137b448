"""Terminal renderer: one merged view per scenario, never N ranks of log spam.

It formats findings; it never decides what a hang or a mismatch is.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from distcheck.files.run_home import shown
from distcheck.launch.rank_output import FOLD_MARK, bare, is_peer_gone
from distcheck.models import PASS, EndReason, Finding, Kind, RankOutcome, Report, ScenarioResult
from distcheck.report.frames import without_own_frames
from distcheck.report.health_table import bandwidth_table, is_bandwidth_table
from distcheck.report.words import ending as _ending
from distcheck.report.words import alike_ranks, error_words, script_name, script_observed
from distcheck.text import plural, rank_list, short_path
from distcheck.torch_features import describe

KIND_STYLE = {
    Kind.HANG: "bold red", Kind.CRASH: "bold red", Kind.MISMATCH: "bold magenta", Kind.ORDER: "bold magenta",
    Kind.COUNT: "magenta", Kind.NUMERIC: "bold yellow", Kind.DUPLICATES: "bold yellow", Kind.STRAGGLER: "yellow",
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
    if result.observed != (PASS,) or not result.collectives_compared:
        return None
    window = " in the --max-duration window" if result.end_reason == "max_duration" else ""
    return Text(f"         clean{window}: {result.collectives_compared:,} collectives on "
                f"{len(result.ranks)} ranks matched, no stall", style="green")


def _rank_table(ranks: tuple[RankOutcome, ...], verbose: bool = False) -> Table:
    table = Table(show_header=True, header_style="dim", box=None, padding=(0, 2), pad_edge=False)
    table.add_column("rank", justify="right")
    table.add_column("state")
    table.add_column("collectives", justify="right")
    table.add_column("where")
    for label, (state, collectives, where) in alike_ranks((r.rank, _rank_row(r, verbose)) for r in ranks):
        table.add_row(label, state, collectives, escape(where))
    return table


def _rank_row(r: RankOutcome, verbose: bool = False) -> tuple[str, str, str]:
    """(state, collectives, where). A stuck rank whose own end was an error (gloo's "Connection closed by peer"
    once its peers left) is shown with that error; ``verbose`` adds the Flight Recorder's own count."""
    exception = error_words(r.exception) if r.exception else ""
    where = exception or (f"killed by {r.signal}" if r.state == "crashed" and r.signal else "")
    state = "error" if r.state == "stuck" and exception else r.state
    if r.where:
        where = f"{where} at {short_path(r.where)}" if where else short_path(r.where)
    if r.state == "stuck" and r.last_event is not None:
        e = r.last_event
        where = f"{e.op} #{e.seq} [{e.label or '-'}] {short_path(e.callsite)}"
        if e.enqueued and r.where and r.where != e.callsite:   # NCCL: the call waits on the device, the host here
            where += f"; not completed, host at {short_path(r.where)}"
        if exception:
            where += f": {exception}"
    if r.flight_recorder and verbose:
        where = f"{where}  {flight_recorder_text(r.flight_recorder)}".strip()
    return state, f"{r.collectives:,}", where or "-"


def shows_error_of(result: ScenarioResult, rank: int | None, verbose: bool = False) -> bool:
    """The result's block shows this rank's own error in its rank table (``scenario_block``)."""
    return _shows_rank_table(result, verbose) and any(r.rank == rank and r.exception for r in result.ranks)


def _shows_rank_table(result: ScenarioResult, verbose: bool) -> bool:
    return (not result.skipped and not (result.ok and not verbose) and bool(result.ranks)
            and bool(result.findings or verbose or not result.ok))


def flight_recorder_text(status: dict[str, dict[str, int]]) -> str:
    """'Flight Recorder's own count, group 0: enqueued 5, started none, completed 4' — the GPU-side truth on
    NCCL, in the backend's numbering (it counts calls distcheck's '#N' may not), so never written '#N'."""
    def seq(n: int | None) -> str:
        return "none" if n is None or n < 0 else str(n)

    parts = []
    for group, s in sorted(status.items()):
        if s:
            parts.append(f"group {group}: enqueued {seq(s.get('last_enqueued_collective'))}, "
                         f"started {seq(s.get('last_started_collective'))}, "
                         f"completed {seq(s.get('last_completed_collective'))}")
    return f"(Flight Recorder's own count, {'; '.join(parts)})" if parts else ""


def finding_block(finding: Finding, expected: bool = False) -> Group:
    """A finding; one the scenario expected (a demonstration found as it should be) says "expected",
    never its severity, so a passing run shows no error line."""
    label = "expected" if expected else finding.severity
    parts = [Text.assemble(("    ", ""),
                           (f"{finding.kind.upper()}", "green" if expected else KIND_STYLE.get(finding.kind, "bold")),
                           (f" [{label}] ", "dim"), finding.summary)]
    # One line per distinct call (role, op, label, line), not one per rank: readable at 1000 ranks.
    calls: dict[tuple, list[int]] = {}
    for d in finding.ranks:
        if finding.kind in (Kind.MISMATCH, Kind.ORDER, Kind.COUNT) and d.callsite:
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


def scenario_block(result: ScenarioResult, verbose: bool = False, flight_recorder: bool | None = None) -> Group:
    """pytest's levels: a result as expected is its one line; one that is not, or ``verbose`` (and a run of
    one target: callers pass it), also its tables, findings (expected ones marked so) and rank table; the rank
    table's Flight Recorder counts where ``flight_recorder`` (default ``verbose``; a run's own -v)."""
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
        parts.append(_rank_table(result.ranks, verbose if flight_recorder is None else flight_recorder))
    if not result.ok:
        parts.extend(_log_tail(result))
    return Group(*parts)


def _log_tail(result: ScenarioResult) -> list[Text]:
    """A failed result's log tail (distcheck's own frames left out); one line where it ends in the backend
    error a rank's row already shows (a consequence: its peers had left)."""
    tail = without_own_frames(result.log_tail or "").splitlines()[-12:]
    last = bare(next((line for line in reversed(tail) if line.strip()), "")).strip()
    repeated = [r.rank for r in result.ranks if r.exception and r.state != "crashed" and is_peer_gone(last)
                and last.startswith(r.exception.strip().splitlines()[0][:80])]
    if repeated:
        return [Text(f"    log tail: rank {repeated[0]}'s traceback of the error in its row above "
                     f"({len(tail)} lines; every line in the run dir's logs)", style="dim")]
    if not tail:
        return []
    return [Text("    log tail (distcheck's own frames left out; every line in the run dir's logs):", style="dim"),
            Text("\n".join("      " + line for line in tail), style="dim")]


def summary_line(report: Report, verbose: bool = False, quiet: bool = False, timeline: bool = False) -> Text:
    """The run's verdict, then (not ``quiet``) what needs the user's attention and where the run dir is (and
    ``timeline``: that its timeline.html was written there); ``verbose`` adds the torch line (what the
    installed torch offers; ``distcheck env`` has it too)."""
    ran = [s for s in report.scenarios if not s.skipped]
    verdict = ("PASS", "bold green") if report.verdict == "pass" else ("FAIL", "bold red")
    if report.nothing_ran:
        verdict = ("NOTHING CHECKED", "bold yellow") if report.unchecked_exit is not None else ("NOTHING RAN",
                                                                                                   "bold yellow")
    # How the whole run ended, where that is not each line's own story: a person or a limit cut it short.
    ended = report.end_reason
    extra = f" ({ended.words})" if ended.interrupted or ended in (EndReason.TIMEOUT, EndReason.MAX_DURATION) else ""
    counts = _counts(ran)
    skipped = len(report.scenarios) - len(ran)
    if report.unchecked_exit is not None:   # no process group: what ran is the command, and how it ended
        counts, skipped = f"  {report.scenarios[-1].source}: no process group, exit {report.unchecked_exit}", 0
    line = Text.assemble(
        "" if quiet else command_output(report), verdict, counts, f", {skipped} skipped" if skipped else "",
        "" if extra and counts.endswith(extra) else extra,   # a script's own line already says it
        (f"  · {report.run.duration_s:.1f} s" if report.unchecked_exit is not None else
         f"  · {report.run.backend} × {report.run.world_size} ranks · {report.run.duration_s:.1f} s", "dim"))
    if quiet:
        return line
    if attention := attention_line(report):
        line.append(f"\n      {attention}", style="bold")
    line.append(f"\n      run dir: {shown(short_path(report.run.run_dir))}"
                + ("  (timeline.html inside)" if timeline else ""), style="dim")
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
    found = sum(1 for s in ok if s.expected != (PASS,))
    kinds = f" ({plural(found, 'planted bug')} found, {len(ok) - found} clean)" if found else ""
    return f"  {len(ok)}/{len(ran)} scenarios behaved as expected{kinds}"


def attention_line(report: Report) -> str:
    """One line naming what needs the user's attention: the targets that did not behave as expected
    (a script that found something), and why nothing ran. Empty for a clean pass."""
    failed = [s for s in report.scenarios if not s.skipped and not s.ok]
    if report.unchecked_exit is not None:   # its skip line says it: nothing distributed ran
        return ""
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
    """``run -- CMD``: the command's own last lines (pytest's "16 passed"), right above the verdict. One line where
    they end in its launcher's report of its children's end (``rank_output.folded_line``: the ranks' own end is
    said above); none of the lines a result above already shows (a skip's reason, a failed result's log tail)."""
    reasons = [s.skipped for s in report.scenarios if s.skipped]
    tails = {line.strip() for s in report.scenarios if not (s.ok or s.skipped)
             for line in (s.log_tail or "").splitlines()}
    lines = [line for line in (report.run.command_output or "").splitlines()
             if line.strip() and line.strip() not in tails and not any(line.strip() in why for why in reasons)]
    if lines and FOLD_MARK in lines[-1]:
        return Text.assemble(("    the command's last output: ", "dim"), (lines[-1][:300] + "\n", "dim"))
    if not lines[-6:]:
        return Text("")
    body = "\n".join("      " + line[:200] for line in lines[-6:])
    return Text.assemble(("    the command's last output:\n", "dim"), (body + "\n", "dim"))


def render(report: Report, console: Console, verbose: bool = False, quiet: bool = False) -> None:
    if not quiet:
        single = len(report.scenarios) == 1   # a run of one target: all there is to say about it
        for result in report.scenarios:
            console.print(scenario_block(result, verbose or single, flight_recorder=verbose))
    console.print(summary_line(report, verbose, quiet), soft_wrap=quiet)
