"""The user's own torchrun-style script (or ``-m module``) as a target: it calls
``init_process_group`` itself; distcheck starts its ranks. A script that starts its own ranks (``mp.spawn``)
is refused with the command to run it with instead (``refuse_self_spawning``)."""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass, replace
from typing import cast
from pathlib import Path

from distcheck.evidence.collect import CollectedRun
from distcheck.errors import UsageError
from distcheck.files import run_dir as rundir
from distcheck.files import user_code
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch.launcher import launch
from distcheck.models import PASS, EndReason, Expectation, RankState
from distcheck.options import RunOptions
from distcheck.targets import Ran, RunContext
from distcheck.targets.launching import judged_across_nodes, launch_spec, worker_common_args


@dataclass(frozen=True)
class ScriptTarget:
    name: str
    file: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    expect: tuple[Expectation, ...] = (PASS,)
    description: str = ""
    script = True
    shares_launch = False
    forked = False   # the user's script imports what it imports, in a process of its own

    @property
    def source(self) -> str:
        return self.file or f"-m {self.module}"

    def headline(self, ranks: str) -> str:
        return f"{self.source} on {ranks}"

    def renamed(self, name: str) -> ScriptTarget:
        return replace(self, name=name)

    def at_world_size(self, world_size: int) -> ScriptTarget:
        return self

    def named_files(self) -> list[str]:
        return ([self.file] if self.file else []) + user_code.named_paths(self.args)

    def as_reported(self, options: RunOptions, run_dir: Path) -> tuple[RunOptions, str | None]:
        """The backend the report states is the one the script's ranks initialized (its own
        ``init_process_group`` names it: ``--backend`` is only what distcheck's scenarios use)."""
        backends = {s.backend for s in LaunchFiles(run_dir / self.name).read_statuses().values() if s.backend}
        return (replace(options, backend=backends.pop()) if len(backends) == 1 else options), None

    def worker_args(self, options: RunOptions, launch_dir: Path) -> tuple[str, ...]:
        what = ("--module", self.module) if self.module else ("--script", cast(str, self.file))   # one of the two
        return (*worker_common_args(options, launch_dir), *what, "--", *self.args)

    def check_collected(self, run: CollectedRun, end_reason: str) -> None:
        """A .py file that never touched torch.distributed is neither a scenario nor a job."""
        if end_reason != EndReason.COMPLETED:
            return
        if run.traces and any(t.events for t in run.traces.values()):
            return
        statuses = list(run.outcomes.values())
        if statuses and all(o.state == RankState.FINISHED for o in statuses) and not run.initialized_process_group:
            raise UsageError(
                f"{self.source} ran to the end on every rank without calling init_process_group, "
                "and it has no @scenario function: there was nothing to check",
                "point distcheck at a distributed script, or decorate scenario functions with @distcheck.scenario",
            )

    def run(self, ctx: RunContext) -> Ran:
        ctx.announce(self)
        launch_dir = ctx.run_dir / self.name
        rundir.prepare_launch_dir(launch_dir)   # a re-used --run-dir: nothing stale mixes into this launch
        channel = ctx.cluster.launch(launch_dir.name, ctx.options.world_size) if ctx.cluster is not None else None
        outcome = launch(launch_spec(ctx.options, launch_dir, self.worker_args(ctx.options, launch_dir), ctx.run_id,
                                     channel), on_poll=ctx.on_poll, on_output=ctx.on_output)
        return Ran([judged_across_nodes(self, ctx.options, launch_dir, outcome, channel)])


# -- `distcheck run script.py` on a script that starts its own ranks --


SPAWNERS = {"spawn", "start_processes"}
SPAWN_MODULES = ("torch.multiprocessing", "multiprocessing")


def spawns_own_ranks(path: Path) -> int | None:
    """The line where ``path`` starts ranks of its own (``mp.spawn``, ``start_processes``), if any.

    Read with ``ast``: the script is not run. Only calls through a name bound to
    ``torch.multiprocessing`` (or imported from it) count.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    modules, functions = _spawn_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in SPAWNERS and _dotted(f.value) in modules:
            return node.lineno
        if isinstance(f, ast.Name) and f.id in functions:
            return node.lineno
    return None


def _spawn_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.multiprocessing, and to its spawn functions."""
    modules, functions = {"torch.multiprocessing"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch.multiprocessing"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.multiprocessing":
            functions |= {a.asname or a.name for a in node.names if a.name in SPAWNERS}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "multiprocessing"}
    return modules, functions


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def refuse_self_spawning(path: Path, script_args: tuple[str, ...]) -> None:
    """Before launch: distcheck would run such a script on every rank, and each would spawn its own."""
    line = spawns_own_ranks(path)
    if line is not None:
        form = shlex.join(["distcheck", "run", "--", "python", str(path), *script_args])
        raise UsageError(f"{path}:{line} starts its own ranks (torch.multiprocessing); run it as a command: {form}")


# -- the launch --
