"""Saved runs: load a run dir back into a Report plus its traces, and list recent runs
(``report.outputs`` writes a report's formats).

A run dir holds ``report.json`` and, per scenario, ``traces/rank*.trace``,
``status/``, ``stacks/`` and ``logs/``: everything ``distcheck report`` needs to
re-render without re-running (pyinstrument's ``Session.load``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from distcheck.errors import CorruptInputError, UsageError
from distcheck.models import EndReason, Event, Finding, Kind, Report, RunInfo, RunSummary, ScenarioResult, Severity
from distcheck.files.launch_dir import LaunchFiles, write_json_atomic
from distcheck.files.run_home import roots_to_search, runs_root
from distcheck.files.trace_reader import read_trace_dir

REPORT_FILE = "report.json"
TIMELINE_FILE = "timeline.html"

Events = dict[str, dict[int, list[Event]]]


@dataclass(frozen=True)
class SavedRun:
    path: Path
    report: Report
    events: Events            # scenario name -> rank -> events, as read from the traces


def write_report(run_dir: Path, report: Report) -> Path:
    """The run dir's ``report.json``, written whole or not at all, in the form ``Report.as_written`` gives (long
    ``group_ranks`` as runs; a large job's shared stacks and alike details once): the one writer of that file, for
    ``run``, ``attach`` and a run that never started. At 4,096 ranks attach's report named every rank's world in
    full: 199 MB, 14 s to write."""
    path = run_dir / REPORT_FILE
    write_json_atomic(path, report.as_written())
    return path


def write_early_report(run_dir: Path, scenarios: tuple[ScenarioResult, ...] = (), interrupted: bool = False,
                       note: str | None = None) -> None:
    """The report of a run that ended before any rank started (interrupted, or its command could not start),
    so ``distcheck report`` and ``distcheck runs`` read it like any other; ``note`` stands for the command's output."""
    import datetime
    import platform
    import shlex
    import sys

    from distcheck.models import VERSION

    torch = sys.modules.get("torch")   # never imported here: an interrupt may come before it is
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = RunInfo(backend="", world_size=0, nnodes=0, nproc_per_node=0,
                   torch_version=getattr(torch, "__version__", ""), distcheck_version=VERSION,
                   command=shlex.join(sys.argv), run_dir=str(run_dir), seed=0, duration_s=0.0, started_at=now,
                   hostname=platform.node(), python_version=platform.python_version(), command_output=note)
    write_report(run_dir, Report(run=info, scenarios=scenarios, interrupted=interrupted))


def write_no_rank_report(launch_dir: Path, name: str, source: str, why: str, end: EndReason | None,
                         log_tail: str | None) -> None:
    """A ``run -- CMD`` none of whose processes became a rank: its one scenario, not run (a crash finding saying
    why, ended as ``end``; or, with no ``end``, skipped: it ran clean without a process group)."""
    result = ScenarioResult(
        name=name, source=source, expected=("pass",), observed=(end.value,) if end else (), ok=False, duration_s=0.0,
        findings=(Finding(kind=Kind.CRASH, severity=Severity.ERROR, summary=why),) if end else (),
        skipped=None if end else why, end_reason=end or EndReason.NOTHING_RAN, launch_dir=str(launch_dir),
        log_tail=log_tail, script=True)
    write_early_report(launch_dir.parent, (result,))


def write_interrupted_before_start(run_dir: Path, signal_name: str) -> None:
    """The report of a run interrupted before it began (no rank started): it ran nothing, and says so."""
    write_early_report(run_dir, interrupted=True,
                       note=f"distcheck was interrupted ({signal_name}) before any rank started: nothing ran")


def resolve_run_dir(target: str | Path, root: Path | None = None) -> Path:
    """A run dir, a path to its report.json, or a run id under ``root`` (default: where runs are saved,
    ``files.run_home``)."""
    path = Path(target)
    if path.is_file() and path.name == REPORT_FILE:
        return path.parent
    if path.is_dir():
        return path
    for folder in [root] if root is not None else roots_to_search():
        by_id = folder / str(target)
        if not path.is_absolute() and by_id.is_dir():
            return by_id
    if path.exists():
        raise UsageError(f"{path} is not a run directory", "pass the directory that holds report.json")
    raise UsageError(f"no run directory at {path}", "list saved runs with 'distcheck runs'")


def _looks_like_run(path: Path) -> bool:
    """A run dir that never got its report: some launch in it has rank records."""
    try:
        return any(LaunchFiles(p).has_rank_records() for p in path.iterdir() if not p.name.startswith("."))
    except OSError:
        return False


def load_report(run_dir: Path) -> Report:
    report_path = run_dir / REPORT_FILE
    if not report_path.exists():
        if _looks_like_run(run_dir):
            raise CorruptInputError(f"{run_dir} has no {REPORT_FILE}: the run did not finish writing it",
                                    f"its traces are still there: 'distcheck analyze {run_dir}' judges the run "
                                    "from them")
        raise UsageError(f"{run_dir} is not a distcheck run directory (no {REPORT_FILE})",
                         "list saved runs with 'distcheck runs'")
    try:
        data = json.loads(report_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CorruptInputError(f"{report_path} is not text", _analyze_hint(run_dir)) from None
    except json.JSONDecodeError as exc:
        raise CorruptInputError(f"{report_path} is not valid JSON (line {exc.lineno}: {exc.msg})",
                                _analyze_hint(run_dir)) from None
    except OSError as exc:
        raise CorruptInputError(f"cannot read {report_path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise CorruptInputError(f"{report_path} is not a distcheck report (top level is not an object)")
    try:
        return Report.from_dict(data)
    except ValueError as exc:
        raise CorruptInputError(f"{report_path}: {exc}", "re-render it with the distcheck that wrote it") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise CorruptInputError(f"{report_path} is not a complete distcheck report ({type(exc).__name__}: {exc})",
                                _analyze_hint(run_dir)) from None


def _analyze_hint(run_dir: Path) -> str:
    """A torn report.json: the run's traces say what it would have said."""
    return f"the file is damaged or was cut short; 'distcheck analyze {run_dir}' re-judges the run from its traces"


def scenario_dir(run_dir: Path, name: str, launch_dir: str | None) -> Path:
    """Where a scenario's files are, also after the run dir was moved or copied."""
    local = run_dir / (Path(launch_dir).name if launch_dir else name)
    if local.is_dir() or not launch_dir:
        return local
    return Path(launch_dir)


def load_events(report: Report, run_dir: Path) -> Events:
    events: Events = {}
    for s in report.scenarios:
        if s.skipped:
            continue
        traces = read_trace_dir(scenario_dir(run_dir, s.name, s.launch_dir) / "traces", reuse=True)
        events[s.name] = {rank: t.events for rank, t in traces.items()}
    return events


def load_run(target: str | Path, root: Path | None = None) -> SavedRun:
    run_dir = resolve_run_dir(target, root)
    report = load_report(run_dir)
    return SavedRun(path=run_dir, report=report, events=load_events(report, run_dir))


# -- listing -----------------------------------------------------------------


def summarize(run_dir: Path) -> RunSummary:
    try:
        report = load_report(run_dir)
    except CorruptInputError as exc:
        verdict = "incomplete" if not (run_dir / REPORT_FILE).exists() else "corrupt"
        return RunSummary(id=run_dir.name, path=str(run_dir), started_at=None, verdict=verdict, problem=exc.message)
    ran = [s for s in report.scenarios if not s.skipped]
    return RunSummary(
        id=run_dir.name, path=str(run_dir), started_at=report.run.started_at, verdict=report.verdict,
        scenarios=len(report.scenarios), ok=sum(1 for s in ran if s.ok), skipped=len(report.scenarios) - len(ran),
        names=tuple(s.name for s in report.scenarios), backend=report.run.backend,
        world_size=report.run.world_size, duration_s=report.run.duration_s, end_reason=str(report.end_reason),
    )


def list_runs(root: Path | None = None, limit: int | None = 20) -> list[RunSummary]:
    """Recent runs under ``root`` (default: where runs are saved), newest first (run ids start with their time)."""
    root = runs_root() if root is None else root
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and ((p / REPORT_FILE).exists() or _looks_like_run(p))]
    dirs.sort(key=lambda p: ((p / REPORT_FILE).stat().st_mtime if (p / REPORT_FILE).exists() else p.stat().st_mtime,
                             p.name), reverse=True)
    if limit is not None:
        dirs = dirs[:limit]
    return [summarize(p) for p in dirs]
