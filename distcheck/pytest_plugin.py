"""pytest plugin: ``@pytest.mark.distributed(nproc=4)`` tests run on N real ranks under
distcheck's launcher, tracer and watchdog (registered through the ``pytest11`` entry point).

A marked test takes ``dist_ctx`` (the scenario context: rank, world_size, device,
generator, check_close, ...) and runs on every rank. The pytest process never runs
its body: it gathers the marked tests of a module (or of the session) that share a
launch configuration, turns them into scenarios of a generated file, runs them with
``session.run_targets`` — one shared launch where that is safe, see ``launch.batch`` —
and maps each ``ScenarioResult`` back to its test. A hang, desync, crash or numeric
difference fails the test with distcheck's diagnosis; a rank's ``assert`` fails it
with that rank's message and traceback.

The plugin stays inert in a session without marked tests: every project that has
distcheck installed loads it.
"""

from __future__ import annotations

import ast
import os
import re
import time
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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distcheck", "distributed tests under distcheck (@pytest.mark.distributed)")
    group.addoption("--distcheck-nproc", type=int, default=None,
                    help="ranks for every distributed test whose mark gives no nproc (default 4)")
    group.addoption("--distcheck-stall-timeout", type=float, default=None,
                    help="seconds without progress while a rank waits in a collective = hang (default 10)")
    group.addoption("--distcheck-busy-timeout", type=float, default=None,
                    help="seconds the others may wait for a rank busy in its own code (default 600)")
    group.addoption("--distcheck-timeout", type=float, default=None,
                    help="seconds for each launch before distcheck ends it")
    group.addoption("--distcheck-backend", default=None, help="auto | gloo | nccl (default auto)")
    group.addoption("--distcheck-run-dir", default=None,
                    help="where traces, logs and reports go (default .distcheck/runs/pytest-<id>)")
    group.addoption("--distcheck-scope", default="module", choices=SCOPES,
                    help="tests that share one launch: a module's (default), the whole session's, or none")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed(nproc=4, stall_timeout=None, timeout=None, busy_timeout=None, backend=None, "
                   "device=None, expect='pass'): run this test on N ranks under distcheck (it takes dist_ctx); "
                   "nproc may be a list to parametrize")
    # No torch and no distcheck internals here: the plugin loads in every pytest run.
    base = config.getoption("--distcheck-run-dir")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_base = Path(base) if base else config.rootpath / ".distcheck" / "runs" / f"pytest-{stamp}-{os.getpid()}"
    config.stash[_STATE] = PluginState(run_base=run_base.resolve())


_STATE = pytest.StashKey[PluginState]()


@pytest.fixture
def dist_nproc() -> int | None:
    """The world size of a distributed test (parametrized from ``nproc=[...]``)."""
    return None


@pytest.fixture
def dist_ctx(request: pytest.FixtureRequest, dist_nproc: int | None) -> Any:
    """The scenario context; it exists only on the ranks of a ``@pytest.mark.distributed`` test."""
    if request.node.get_closest_marker(MARK) is None:
        pytest.fail("dist_ctx exists only in @pytest.mark.distributed tests (the test body runs on the ranks)",
                    pytrace=False)
    return None   # the pytest process never runs the body; see pytest_pyfunc_call


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker(MARK)
    if mark is None:
        return
    nproc = mark.kwargs.get("nproc", mark.args[0] if mark.args else None)
    if isinstance(nproc, (list, tuple)):
        metafunc.parametrize("dist_nproc", list(nproc), ids=[f"nproc{n}" for n in nproc])


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plan every selected marked test (after deselection, so -k decides what shares a launch)."""
    state = config.stash[_STATE]
    state.planned = {item.nodeid: plan_item(item, i) for i, item in enumerate(items)
                     if item.get_closest_marker(MARK) is not None}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A marked test's body runs on the ranks: run its group if not yet run, then judge it."""
    state = pyfuncitem.config.stash[_STATE]
    planned = state.planned.get(pyfuncitem.nodeid)
    if planned is None:
        return None
    from distcheck import pytest_runner   # imports torch: only once a marked test runs

    if pyfuncitem.nodeid not in state.outcomes:
        pytest_runner.run_group(state, planned)
    outcome = state.outcomes[pyfuncitem.nodeid]
    if outcome.run_dir:   # JUnit XML carries it as a property: CI can link the artifact
        pyfuncitem.user_properties.append(("distcheck_run_dir", outcome.run_dir))
    pytest_runner.judge(pyfuncitem, outcome)
    return True


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.outcomes:
        return
    terminalreporter.write_line(
        f"distcheck: {len(state.outcomes)} distributed test(s) in {state.launches} launch(es) "
        f"({state.groups} group(s)), {state.seconds:.1f} s; run dir {state.run_base}")
