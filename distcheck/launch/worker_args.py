"""The launcher's side of the worker contract: the argv after ``python -m distcheck.rank.worker``
(``rank/worker.py`` parses it)."""

from __future__ import annotations

from pathlib import Path

from distcheck.discovery import ScriptSpec, Target
from distcheck.options import RunOptions, pg_timeout
from distcheck.scenario import ScenarioSpec


def worker_args(spec: Target | list[ScenarioSpec], options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
    """Arguments for a script, a scenario, or a batch of scenarios."""
    common = ("--launch-dir", str(launch_dir), "--backend", options.backend, "--device", options.device,
              "--seed", str(options.seed), "--pg-timeout", str(pg_timeout(options)))
    if isinstance(spec, ScriptSpec):
        what = ("--module", spec.module) if spec.module else ("--script", spec.file)
        return (*common, *what, "--", *spec.args)
    opts = tuple(a for key, value in options.scenario_options for a in ("--option", f"{key}={value}"))
    specs = spec if isinstance(spec, list) else [spec]
    pairs = tuple(a for s in specs for a in ("--scenario-file", s.file, "--scenario-name", s.name))
    return (*common, *opts, *pairs)
