"""The pytest plugin's plan: which marked tests share a launch, and how each becomes a scenario
of a generated file. Pure pytest: no torch and no distcheck internals (the plugin loads in every
pytest run).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

MARK = "distributed"
# What the mark takes, besides nproc: each overrides the command line's option for that test.
MARK_KEYS = ("nproc", "stall_timeout", "timeout", "busy_timeout", "backend", "device", "expect")
SCOPES = ("module", "session", "test")


@dataclass(frozen=True)
class LaunchKey:
    """Tests with the same key may share one launch (one ``run_targets`` call)."""

    scope: str              # the module's path, "session", or the test's node id
    nproc: int
    backend: str
    device: str
    stall_timeout: float
    busy_timeout: float
    timeout: float | None


@dataclass
class Planned:
    """One marked test as a scenario of a generated file."""

    item: pytest.Item
    name: str               # the scenario's (and launch dir's) name
    key: LaunchKey
    expect: tuple[str, ...]
    params: dict[str, Any]
    problem: str | None = None   # why it cannot run on the ranks (reported as its failure)


@dataclass
class Outcome:
    """What became of one test: the result, or why there is none."""

    result: Any = None      # ScenarioResult
    error: str | None = None
    run_dir: str | None = None


@dataclass
class PluginState:
    run_base: Path
    planned: dict[str, Planned] = field(default_factory=dict)     # by node id
    outcomes: dict[str, Outcome] = field(default_factory=dict)    # by node id
    launches: int = 0
    groups: int = 0
    seconds: float = 0.0


def _mark_value(item: pytest.Item, key: str, option: str | None, default: Any) -> Any:
    """The mark's value, else the command line's, else distcheck run's default."""
    mark = item.get_closest_marker(MARK)
    if mark is not None and mark.kwargs.get(key) is not None:
        return mark.kwargs[key]
    given = item.config.getoption(option) if option else None
    return default if given is None else given


def _nproc(item: pytest.Item) -> int:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("dist_nproc") is not None:
        return int(params["dist_nproc"])
    mark = item.get_closest_marker(MARK)
    positional = mark.args[0] if mark is not None and mark.args else None
    value = _mark_value(item, "nproc", "--distcheck-nproc", positional or 4)
    return int(value)


def _scope(item: pytest.Item) -> str:
    scope = item.config.getoption("--distcheck-scope")
    if hasattr(item.config, "workerinput"):
        # Under pytest-xdist each worker gets tests one by one and cannot know which of a
        # module's tests will come to it: sharing a launch would run tests of other workers.
        scope = "test"
    return {"module": str(item.path), "session": "session"}.get(scope, item.nodeid)


def launch_key(item: pytest.Item) -> LaunchKey:
    stall = float(_mark_value(item, "stall_timeout", "--distcheck-stall-timeout", 10.0))
    return LaunchKey(
        scope=_scope(item), nproc=_nproc(item),
        backend=str(_mark_value(item, "backend", "--distcheck-backend", "auto")),
        device=str(_mark_value(item, "device", None, "auto")), stall_timeout=stall,
        busy_timeout=float(_mark_value(item, "busy_timeout", "--distcheck-busy-timeout", 600.0)),
        timeout=_mark_value(item, "timeout", "--distcheck-timeout", None),
    )


def _scenario_name(item: pytest.Item, index: int) -> str:
    """A Python identifier (the generated function) that also names the launch dir."""
    return f"{re.sub(r'[^0-9A-Za-z_]+', '_', item.name).strip('_')}__{index}"


def _problem(item: pytest.Item, params: dict[str, Any]) -> str | None:
    """Why a marked test cannot run on the ranks, or None."""
    if not isinstance(item, pytest.Function) or item.cls is not None:
        return "a distributed test must be a module-level function (the ranks import it by name)"
    own = set(item._fixtureinfo.argnames) - {"dist_ctx", "dist_nproc"} - set(params)
    if own:
        return (f"a distributed test takes dist_ctx and parametrize arguments only; {', '.join(sorted(own))} "
                "would be a fixture of the pytest process, which never runs the test's body")
    for name, value in params.items():
        try:
            same = ast.literal_eval(repr(value)) == value
        except (ValueError, SyntaxError):
            same = False
        if not same:
            return f"parametrize value {name}={value!r} is not a literal: the ranks cannot rebuild it"
    return None


def plan_item(item: pytest.Item, index: int) -> Planned:
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    params.pop("dist_nproc", None)
    expect = _mark_value(item, "expect", None, "pass")
    expect = (expect,) if isinstance(expect, str) else tuple(expect)
    return Planned(item=item, name=_scenario_name(item, index), key=launch_key(item), expect=expect,
                   params=params, problem=_problem(item, params))
