"""Finding scenarios: built-in names, scenario files and folders.

Scenario files are read with ``ast``, not imported, so listing and selecting
scenarios never runs their code or needs their optional dependencies.
"""

from __future__ import annotations

import ast
import difflib
import os
from pathlib import Path

from distcheck.errors import UsageError
from distcheck.launch.command import command_spec
from distcheck.models import PASS
from distcheck.options import NodeConfig, RunFlags, check_command_flags
from distcheck.scenario import BACKENDS, EXPECTATIONS, ScenarioSpec, expectations_by_world_size
from distcheck.targets import Target
from distcheck.targets.scenario import ScenarioTarget
from distcheck.targets.command import CommandTarget
from distcheck.targets.script import ScriptTarget, refuse_self_spawning


def builtin_dir() -> Path:
    """Where the built-in scenarios live: the installed package, or the checkout."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "builtin_scenarios"
    if installed.is_dir():
        return installed
    return package.parent / "scenarios"


def _literal(node: ast.expr, what: str, path: Path) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise UsageError(
            f"{path}:{node.lineno}: @scenario({what}=...) must be a literal",
            "write the value out (a string or a tuple of strings) so distcheck can read it without importing the file",
        ) from None


def _as_tuple(value: object) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]


def _decorator_call(fn: ast.FunctionDef) -> ast.Call | ast.Name | ast.Attribute | None:
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "scenario":
            return deco  # type: ignore[return-value]
    return None


def scenarios_in_file(path: Path, builtin: bool = False) -> list[ScenarioSpec]:
    """Every ``@scenario`` function of a file, in source order."""
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read scenario file {path}: {exc.strerror}") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:   # the user's own file, scenario or script: its line, as Python names it
        line = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        raise UsageError(
            f"{path}:{exc.lineno}: syntax error in your script{line} ({exc.msg})",
            f"fix line {exc.lineno} of {path.name} and run again ('python {path}' shows the same error)",
        ) from None
    specs = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        deco = _decorator_call(node)
        if deco is None:
            continue
        kwargs = {kw.arg: kw.value for kw in deco.keywords} if isinstance(deco, ast.Call) else {}
        if isinstance(deco, ast.Call) and deco.args:
            kwargs.setdefault("expect", deco.args[0])
        expect = _as_tuple(_literal(kwargs["expect"], "expect", path)) if "expect" in kwargs else (PASS,)
        bad = [e for e in expect if e not in EXPECTATIONS]
        if bad:
            raise UsageError(
                f"{path}:{node.lineno}: unknown expectation {bad[0]!r} for scenario {node.name}",
                f"use one of: {', '.join(EXPECTATIONS)}",
            )
        doc = ast.get_docstring(node) or ""
        specs.append(ScenarioSpec(
            name=node.name,
            file=str(path.resolve()),
            expect=expect,
            requires=_as_tuple(_literal(kwargs["requires"], "requires", path)) if "requires" in kwargs else (),
            backends=_as_tuple(_literal(kwargs["backends"], "backends", path)) if "backends" in kwargs else BACKENDS,
            min_world_size=int(_literal(kwargs["min_world_size"], "min_world_size", path))  # type: ignore[call-overload]
            if "min_world_size" in kwargs else 2,
            description=" ".join(doc.strip().split("\n\n")[0].split()),
            builtin=builtin,
            expect_by_world_size=_by_world_size(kwargs, path, node),
        ))
    return specs


def _by_world_size(kwargs: dict[str | None, ast.expr], path: Path, node: ast.FunctionDef
                   ) -> tuple[tuple[int, tuple[str, ...]], ...]:
    if "expect_by_world_size" not in kwargs:
        return ()
    value = _literal(kwargs["expect_by_world_size"], "expect_by_world_size", path)
    try:
        return expectations_by_world_size(value if isinstance(value, dict) else {None: value},  # type: ignore[dict-item]
                                          f"{path}:{node.lineno}")
    except ValueError as exc:
        raise UsageError(str(exc), "write it as {2: \"hang\"}: a rank count and what the scenario expects there") \
            from None


def builtin_scenarios() -> list[ScenarioSpec]:
    specs: list[ScenarioSpec] = []
    for path in sorted(builtin_dir().glob("*.py")):
        if path.name.startswith("_"):
            continue
        specs.extend(scenarios_in_file(path, builtin=True))
    return specs


def run_targets_of(names: list[str], module: str | None, after_dashes: tuple[str, ...], flags: RunFlags,
                   nodes: NodeConfig) -> list[Target]:
    """What ``distcheck run`` runs: scenarios, one script, or — nothing before ``--`` —
    the user's own launch command (``distcheck run -- torchrun ... train.py``)."""
    if not names and not module and after_dashes:
        check_command_flags(flags, nodes)
        return [CommandTarget(command_spec(after_dashes))]
    return resolve_run_targets(names, module=module, script_args=after_dashes)


def resolve_run_targets(targets: list[str], module: str | None = None,
                        script_args: tuple[str, ...] = ()) -> list[Target]:
    """What ``distcheck run`` runs: scenarios, or one script/module with its arguments.

    A ``.py`` file without any ``@scenario`` function is an ordinary script, run
    on every rank the way torchrun would run it.
    """
    if module:
        if targets:
            raise UsageError("give either -m MODULE or targets, not both",
                             "pass the module's own arguments after '--'")
        return [ScriptTarget(name=module.rsplit(".", 1)[-1], module=module, args=script_args,
                             description=f"python -m {module}")]
    if len(targets) == 1 and targets[0].endswith(".py") and Path(targets[0]).is_file():
        path = Path(targets[0])
        if not scenarios_in_file(path):
            refuse_self_spawning(path, script_args)
            return [ScriptTarget(name=path.stem, file=str(path.resolve()), args=script_args,
                                 description=f"script {path}")]
    if script_args:
        raise UsageError("arguments after '--' are for a script, and no script was given",
                         "run 'distcheck run path/to/script.py -- ARGS' with a single script")
    return [ScenarioTarget(spec) for spec in resolve_targets(targets)]


def resolve_targets(targets: list[str]) -> list[ScenarioSpec]:
    """Scenario specs for the command line's targets (none = all built-ins)."""
    if not targets:
        return builtin_scenarios()
    builtins = {s.name: s for s in builtin_scenarios()}
    specs: list[ScenarioSpec] = []
    for target in targets:
        path = Path(target)
        if target in builtins and not path.exists():
            specs.append(builtins[target])
        elif path.is_dir():
            found = [s for p in sorted(path.glob("*.py")) if not p.name.startswith("_") for s in scenarios_in_file(p)]
            if not found:
                raise UsageError(f"no @scenario functions in folder {path}",
                                 "add scenario files, or name a built-in scenario")
            specs.extend(found)
        elif path.is_file():
            found = scenarios_in_file(path)
            if not found:
                raise UsageError(
                    f"{path} has no @scenario function",
                    "decorate a function with @distcheck.scenario(...), or run it alone as a script "
                    "('distcheck run path/to/script.py -- ARGS') if it calls init_process_group itself",
                )
            specs.extend(found)
        elif _looks_like_a_path(target):
            raise UsageError(f"{target}: no such file or directory",
                             "check the path (relative to the current directory); 'distcheck list' shows the "
                             "built-in scenarios")
        else:
            raise unknown_target(target, sorted(builtins))
    return specs


def _looks_like_a_path(target: str) -> bool:
    """A file the user meant (``train.py``, ``jobs/eval``), not a built-in scenario's name."""
    return target.endswith(".py") or os.sep in target or (os.altsep is not None and os.altsep in target)


def unknown_target(target: str, names: list[str]) -> UsageError:
    """A one-line error; the hint offers the closest built-in names first (a typo is the usual cause)."""
    close = difflib.get_close_matches(target, names, n=3, cutoff=0.6)
    if close:
        return UsageError(f"unknown scenario or file: {target!r}; did you mean {' or '.join(map(repr, close))}?",
                          "'distcheck list' shows every built-in scenario")
    return UsageError(f"unknown scenario or file: {target!r}", f"built-in scenarios: {', '.join(names) or '(none)'}")
