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

import os
import time
from pathlib import Path
from typing import Any

import pytest

from distcheck.files.run_home import runs_root
from distcheck.pytest.plan import MARK, SCOPES, PluginState, plan_item

# Set by ``distcheck run -- CMD`` for everything the command starts (launch.command).
LAUNCH_DIR_ENV = "DISTCHECK_LAUNCH_DIR"


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
                    help="where traces, logs and reports go (default: distcheck's runs folder, "
                         "~/.local/state/distcheck/runs/pytest-<id>)")
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
    run_base = Path(base) if base else runs_root() / f"pytest-{stamp}-{os.getpid()}"   # never in the suite's tree
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Under ``distcheck run -- pytest``: say which test this process runs now. The ranks a test
    starts (or a pool's workers it hands work to) read it when they initialize, so each generation
    of ranks is judged as that test's (``rank.injected.current_test``)."""
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    if not launch_dir:
        yield
        return
    from distcheck.files.launch_dir import LaunchFiles   # no torch: only the launch dir's layout

    files = LaunchFiles(Path(launch_dir))
    files.write_current_test(os.getpid(), item.nodeid)
    try:
        yield
    finally:
        files.write_current_test(os.getpid(), None)


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
    from distcheck.pytest import runner   # imports torch: only once a marked test runs

    if pyfuncitem.nodeid not in state.outcomes:
        runner.run_group(state, planned)
    outcome = state.outcomes[pyfuncitem.nodeid]
    if outcome.run_dir:   # JUnit XML carries it as a property: CI can link the artifact
        pyfuncitem.user_properties.append(("distcheck_run_dir", outcome.run_dir))
    runner.judge(pyfuncitem, outcome)
    return True


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.outcomes:
        return
    terminalreporter.write_line(
        f"distcheck: {len(state.outcomes)} distributed test(s) in {state.launches} launch(es) "
        f"({state.groups} group(s)), {state.seconds:.1f} s; run dir {state.run_base}")
