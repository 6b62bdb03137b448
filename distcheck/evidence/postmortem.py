"""Post-mortem: turn Flight Recorder dumps or distcheck traces into a Report.

``distcheck analyze PATH...`` lands here. The paths are sorted into sources —
one set of Flight Recorder dumps (one file per rank, pickle or JSON: see
``from_dumps``), and any number of distcheck launch directories
(``traces/rank*.trace`` plus status and stack files: see ``from_traces``) — each
becomes one ``ScenarioResult`` through the very same ``verdict`` as a live run.
File order never matters: every rank is keyed by its number and the expected
call is decided by majority.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcheck.diagnose.blame import attribute_by_majority
from distcheck.evidence.from_dumps import FR_SCENARIO, analyze_dumps, common_dir
from distcheck.evidence.from_traces import analyze_launch
from distcheck.diagnose.verdict import run_info
from distcheck.errors import UsageError
from distcheck.files.flight_recorder import rank_from_name, sniff
from distcheck.files.launch_dir import read_json
from distcheck.files.saved_runs import REPORT_FILE
from distcheck.models import Event, Report, ScenarioResult

# What callers of the post-mortem have always found here.
__all__ = ["FR_SCENARIO", "PostMortem", "Sources", "analyze_dumps", "analyze_launch", "analyze_paths",
           "attribute_by_majority", "find_sources"]


@dataclass(frozen=True)
class PostMortem:
    """The report, and the events behind it (for timelines): scenario → rank → events."""

    report: Report
    events: dict[str, dict[int, list[Event]]]


@dataclass
class Sources:
    dumps: list[Path] = field(default_factory=list)            # Flight Recorder files
    launches: list[Path] = field(default_factory=list)         # dirs holding traces/


def find_sources(paths: Sequence[Path]) -> Sources:
    """Sort the given paths into dump files and distcheck launch directories."""
    if not paths:
        raise UsageError("nothing to analyze: give Flight Recorder dumps, a directory of them, or a distcheck run dir")
    found = Sources()
    for path in paths:
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        if path.is_file():
            if path.suffix == ".trace":
                _add(found.launches, path.parent.parent if path.parent.name == "traces" else path.parent)
            else:
                found.dumps.append(path)
            continue
        if (path / "traces").is_dir():
            _add(found.launches, path)
        elif any(path.glob("rank*.trace")):
            _add(found.launches, path.parent if path.name == "traces" else path)
        elif launches := sorted(p for p in path.iterdir() if (p / "traces").is_dir()):
            for launch in launches:
                _add(found.launches, launch)
        else:
            dumps = sorted(p for p in path.iterdir() if p.is_file() and _looks_like_dump(p))
            if not dumps:
                raise UsageError(f"{path}: no Flight Recorder dumps or distcheck traces in this directory",
                                 "give the dump files (PREFIX<rank>), their directory, or a distcheck run dir")
            found.dumps.extend(dumps)
    return found


def _add(items: list[Path], path: Path) -> None:
    if path.resolve() not in {p.resolve() for p in items}:
        items.append(path)


def _looks_like_dump(path: Path) -> bool:
    if rank_from_name(path) is None:
        return False
    try:
        with open(path, "rb") as f:
            return sniff(f.read(64)) is not None
    except OSError:
        return False


def analyze_paths(paths: Sequence[Path], world_size: int | None = None, command: str = "") -> PostMortem:
    """Everything the given paths say, as one Report."""
    started = time.time()
    sources = find_sources(paths)
    results: list[ScenarioResult] = []
    events: dict[str, dict[int, list[Event]]] = {}
    backends: set[str] = set()
    versions: dict[str, str] = {}
    world = 0
    if sources.dumps:
        result, info = analyze_dumps(sources.dumps, world_size)
        results.append(result)
        events[result.name] = info["events"]
        backends |= info["backends"]
        versions.update(info["versions"])
        world = max(world, info["world_size"])
    for launch in sources.launches:
        result, launch_world, launch_events = analyze_launch(launch)
        if result.name in events:             # two run dirs with the same scenario
            result = dataclasses.replace(result, name=f"{result.name}-{len(results) + 1}")
        results.append(result)
        events[result.name] = launch_events
        world = max(world, launch_world)
    run_dir = common_dir([*sources.dumps, *sources.launches])
    saved_run: dict[str, Any] = {}
    if sources.launches and not sources.dumps:
        run_dir = common_dir([p.parent for p in sources.launches])
        saved = read_json(run_dir / REPORT_FILE)
        saved_run = saved["run"] if isinstance(saved, dict) and isinstance(saved.get("run"), dict) else {}
    if saved_run.get("backend"):
        backends.add(saved_run["backend"])
    run = run_info(
        backend="+".join(sorted(backends)) or "unknown", world_size=world, nnodes=_int(saved_run.get("nnodes")) or 1,
        nproc_per_node=_int(saved_run.get("nproc_per_node")) or world,   # dumps do not say: one node assumed
        torch_version=str(saved_run.get("torch_version", "unknown")), command=command, run_dir=str(run_dir),
        seed=_int(saved_run.get("seed")), started=started, ended=time.time(), versions=versions,
    )
    return PostMortem(report=Report(run=run, scenarios=tuple(results)), events=events)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0
