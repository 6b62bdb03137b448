"""The live view while ``distcheck run`` works: a status line per scenario and,
during a stall, what every rank is doing (grouped, so 1000 ranks stay readable).

On a terminal it is a rich ``Live`` display; elsewhere (CI logs, pipes) it is
plain lines: one when a scenario starts, one when a stall is suspected, and the
scenario's result block. It renders what the watchdog observed
(``launch.progress.RankProgress``, read through the ``RankProgress`` protocol below,
so the report package does not depend on the launcher); it decides nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from distcheck.launch.rank_output import Ends, shown_with_prefix
from distcheck.report import terminal
from distcheck.report.frames import OwnFrames
from distcheck.text import rank_list, short_path

MAX_ROWS = 12
ANNOUNCE_AFTER_S = 10.0     # plain output: a later launch's RUN line once it has run this long (a quiet 10 s: a CI
                            # log says what runs; shorter, a loaded node's first run outgrew one screen)


class RankProgress(Protocol):
    """What the view reads of one rank's progress (the watchdog's ``RankProgress`` satisfies it)."""

    @property
    def open_collectives(self) -> int: ...
    @property
    def phase(self) -> str | None: ...
    @property
    def current(self) -> str | None: ...
    @property
    def since(self) -> float | None: ...
    @property
    def label(self) -> str | None: ...
    @property
    def dead(self) -> bool: ...
    @property
    def late(self) -> bool: ...
    @property
    def busy_at(self) -> str | None: ...
    @property
    def evidence(self) -> str | None: ...   # the progress a rank outside the collectives shows


@dataclass(frozen=True)
class LiveState:
    """What the view knows at one moment."""

    name: str | None = None
    index: int = 0
    total: int = 0
    started: float | None = None                  # wall time the scenario started
    progress: Mapping[int, RankProgress] | None = None
    idle_s: float = 0.0                           # seconds since any rank made progress


def rank_state(p: RankProgress) -> tuple[str, str]:
    """(text, style) of one rank's state."""
    if p.dead:
        return "dead", "bold red"
    if p.late:
        return f"late, not hung: {p.evidence}", "magenta"
    if p.open_collectives:
        return "waiting", "yellow"
    if p.phase is None or p.phase == "starting":
        return "starting", "dim"
    if p.phase == "finished":
        return "finished", "green"
    return p.phase, ""


def _counts(progress: Mapping[int, RankProgress]) -> str:
    by: dict[str, int] = {}
    for p in progress.values():
        text, _ = rank_state(p)
        by[text] = by.get(text, 0) + 1
    return ", ".join(f"{n} {text}" for text, n in sorted(by.items()))


def _stalling(state: LiveState) -> bool:
    """Worth showing the ranks: no progress for a second while someone waits in a collective or died."""
    progress = state.progress or {}
    return state.idle_s >= 1.0 and any(p.open_collectives or p.dead for p in progress.values())


def status_line(state: LiveState, now: float, stall_timeout: float, busy_timeout: float | None = None) -> Text:
    if state.name is None:
        return Text("  starting…", style="dim")
    elapsed = now - state.started if state.started else 0.0
    line = Text.assemble(("  RUN  ", "bold cyan"), (state.name, "bold"),
                         (f" [{state.index + 1}/{state.total}] {elapsed:.1f} s", "dim"))
    if state.progress:
        line.append(f" · {_counts(state.progress)}", style="dim")
    if _stalling(state):
        late = _late(state)
        limit = busy_timeout if late and busy_timeout else stall_timeout
        line.append(f" · no progress for {state.idle_s:.1f}/{limit:g} s",
                    style="bold yellow" if state.idle_s >= limit / 2 else "yellow")
        if late:
            line.append(f" · waiting for busy {rank_list(late)} (late, not hung)", style="magenta")
    return line


def _late(state: LiveState) -> list[int]:
    return sorted(r for r, p in (state.progress or {}).items() if p.late)


def late_line(state: LiveState, busy_timeout: float) -> str:
    """The plain-output line once the stall timeout passed while a rank is still busy."""
    progress = state.progress or {}
    where = "; ".join(f"rank {r} at {short_path(progress[r].busy_at)}" + _shown_by(progress[r].evidence)
                      if progress[r].busy_at else f"rank {r}" + _shown_by(progress[r].evidence) for r in _late(state))
    return (f"        {where}: late, not hung; distcheck keeps waiting, up to --busy-timeout {busy_timeout:g} s")


def _shown_by(evidence: str | None) -> str:
    """What showed the rank making progress, as measured (its process tree's CPU or I/O, its stack), never a guess."""
    return f" ({evidence})" if evidence else ""


def rank_rows(progress: Mapping[int, RankProgress], now: float) -> list[tuple[str, str, str, str, str, str]]:
    """(ranks, state, style, collective, label, for) rows, ranks with the same state merged."""
    groups: dict[tuple[str, str | None, str | None], list[int]] = {}
    styles: dict[tuple, str] = {}
    longest: dict[tuple, float] = {}
    for rank, p in sorted(progress.items()):
        text, style = rank_state(p)
        key = (text, p.current, p.label or (f"at {short_path(p.busy_at)}" if p.busy_at else None))
        groups.setdefault(key, []).append(rank)
        styles[key] = style
        if p.since is not None:
            longest[key] = max(longest.get(key, 0.0), now - p.since)
    rows = []
    for key, ranks in groups.items():
        text, current, label = key
        waited = f"{longest[key]:.1f} s" if key in longest else ""
        rows.append((rank_list(ranks), text, styles[key], current or "", label or "", waited))
    return rows


def rank_table(progress: Mapping[int, RankProgress], now: float) -> Table:
    table = Table(show_header=True, header_style="dim", box=None, padding=(0, 1), pad_edge=False)
    table.add_column("      ranks", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("collective", no_wrap=True)
    table.add_column("label", no_wrap=True, overflow="ellipsis", min_width=12)
    table.add_column("for", justify="right", no_wrap=True)
    rows = rank_rows(progress, now)
    for ranks, text, style, current, label, waited in rows[:MAX_ROWS]:
        table.add_row("      " + ranks, Text(text, style=style), escape(current), escape(label), waited)
    if len(rows) > MAX_ROWS:
        table.add_row("      …", f"{len(rows) - MAX_ROWS} more states", "", "", "")
    return table


def renderable(state: LiveState, now: float, stall_timeout: float, busy_timeout: float | None = None) -> Group:
    parts: list = [status_line(state, now, stall_timeout, busy_timeout)]
    if _stalling(state):
        parts.append(rank_table(state.progress or {}, now))
    return Group(*parts)


def stall_line(state: LiveState, now: float) -> str:
    """The plain-output line for a suspected stall."""
    rows = rank_rows(state.progress or {}, now)
    parts = []
    for ranks, text, _, current, label, waited in rows:
        what = f"in {current}" if current else text
        if label:
            what += f" [{label}]"
        if waited:
            what += f" for {waited}"
        parts.append(f"{ranks} {what}")
    return f"        no progress for {state.idle_s:.1f} s: " + "; ".join(parts)


class LiveView:
    """Plugs into ``RunHooks``: ``scenario_started``, ``scenario_finished``, ``on_poll``.

    ``on_poll`` runs on the watchdog thread; it only stores what it was given
    (and, in plain mode, prints one line when a stall is suspected).
    """

    def __init__(self, console: Console, *, stall_timeout: float, verbose: bool = False,
                 clock: Callable[[], float] = time.time, interactive: bool | None = None,
                 busy_timeout: float | None = None, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet          # -q: nothing but the summary line the caller prints
        self.stall_timeout = stall_timeout
        self.busy_timeout = busy_timeout
        self.verbose = verbose
        self.clock = clock
        self.interactive = (console.is_terminal and not console.is_dumb_terminal) if interactive is None \
            else interactive
        self.state = LiveState()
        self._stall_reported = False
        self._late_reported = False
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._open: dict[str, str] = {}     # started, no result yet (a shared launch's targets): "[i/n]"
        self._announced: set[str] = set()   # whose RUN line is printed
        self._frames: dict[int | None, OwnFrames] = {}   # per rank: inside a distcheck frame of a traceback
        self._ends: dict[int | None, Ends] = {}    # per rank (None: the command itself): what only reports an end

    # rich calls this on every refresh
    def __rich__(self) -> Group:
        return renderable(self.state, self.clock(), self.stall_timeout, self.busy_timeout)

    def __enter__(self) -> LiveView:
        if self.interactive:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=True,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def scenario_started(self, spec, index: int, total: int) -> None:
        with self._lock:
            self.state = LiveState(name=spec.name, index=index, total=total, started=self.clock())
            self._stall_reported = self._late_reported = False
            first = not self._open
            self._open[spec.name] = f"[{index + 1}/{total}]"
        # Plain output pairs a start with its result: a target's RUN line comes at once only for the run's
        # first launch (the wait for the rendezvous); a later launch's once it has taken ANNOUNCE_AFTER_S
        # (a quick one is just its result line). A shared launch's other targets get theirs (-v) right
        # above their result, or with a stall line about them.
        if first and not self._announced:
            self._announce(spec.name)

    def _announce(self, name: str | None) -> None:
        if self.interactive or self.quiet or name is None or name in self._announced:
            return
        self._announced.add(name)
        self.console.print(f"  RUN  {name}  {self._open.get(name, '')}".rstrip(), style="dim", markup=False,
                           highlight=False, soft_wrap=True)

    def rank_line(self, rank: int | None, line: str) -> None:
        """A line a rank wrote, as torchrun shows it ("[rank0]:loss 0.25", one prefix; a command's own line, before
        its ranks had logs, as it is), through the view's own console (a live display stays below it);
        distcheck's traceback frames left out (the log keeps them). What only reports an end waits for the
        result (``rank_output.Ends``): a launcher's report of its children's end, a rank's backend error after
        its peers left."""
        frames = self._frames.setdefault(rank, OwnFrames())
        if not frames.keep(line):
            return
        with self._lock:
            shown = self._ends.setdefault(rank, Ends(launcher=rank is None)).feed(line)
        self._print_lines(rank, shown)

    def _print_lines(self, rank: int | None, lines: list[str]) -> None:
        for line in lines:
            self.console.print(shown_with_prefix(rank, line), markup=False, highlight=False, soft_wrap=True,
                               style="")

    def _held_ends(self, result, verbose: bool) -> None:
        """The ranks' output is over: a launcher's folded end is the summary's one line (``terminal.command_output``);
        a rank's backend error stays out where the result's rank table shows it; anything else held is shown now."""
        with self._lock:
            ends, self._ends = self._ends, {}
        for rank, source in sorted(ends.items(), key=lambda item: -1 if item[0] is None else item[0]):
            state, held = source.end()
            if state == "folded" or (state == "consequence" and terminal.shows_error_of(result, rank, verbose)):
                continue
            self._print_lines(rank, held)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        self.console.print(f"  {text}", style="dim", markup=False, highlight=False, soft_wrap=True)

    def on_poll(self, progress: Mapping[int, RankProgress], idle_s: float) -> None:
        with self._lock:
            state = LiveState(name=self.state.name, index=self.state.index, total=self.state.total,
                              started=self.state.started, progress=dict(progress), idle_s=idle_s)
            self.state = state
            report = late = False
            threshold = max(1.0, self.stall_timeout / 2)
            if idle_s < threshold:
                self._stall_reported = self._late_reported = False
            elif not self._stall_reported and _stalling(state):
                self._stall_reported = report = True
            if (idle_s >= self.stall_timeout and not self._late_reported and _late(state)
                    and state.progress is not None and all(state.progress[r].busy_at for r in _late(state))):
                self._late_reported = late = True
        if self.interactive or self.quiet:
            return
        if len(self._open) == 1 and state.started is not None and self.clock() - state.started >= ANNOUNCE_AFTER_S:
            self._announce(state.name)    # a launch of its own that takes a while: say what runs
        if report or late:
            self._announce(state.name)    # the line says which target the ranks are in
        if report:
            self.console.print(stall_line(state, self.clock()), style="yellow", markup=False, highlight=False,
                               soft_wrap=True)
        if late:
            self.console.print(late_line(state, self.busy_timeout or 0), style="magenta", markup=False,
                               highlight=False, soft_wrap=True)

    def scenario_finished(self, result) -> None:
        with self._lock:
            total = self.state.total
            self.state = LiveState(name=None, index=self.state.index, total=total)
        if self.verbose:
            self._announce(result.name)
        with self._lock:
            self._open.pop(result.name, None)
        if self.quiet:
            return
        self._held_ends(result, self.verbose or total == 1)
        # a run of one target: all there is to say about it (a demonstration's diagnosis, a node check's table)
        self.console.print(terminal.scenario_block(result, self.verbose or total == 1, flight_recorder=self.verbose))
