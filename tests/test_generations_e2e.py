"""Issue 25: real distributed test suites under `distcheck run -- python -m pytest`, on real gloo ranks.

Two suites whose ranks come and go: PyTorch's MultiProcessTestCase (fresh processes per test) and a
pool of 2 workers in torchmetrics' style (each test re-inits the group in both workers on one port,
a worker perhaps under another rank). Each test's generation of ranks gets its own verdict, named by
its pytest node id. Every run has a hard timeout, and no process the command started may survive
(found by the DISTCHECK_LAUNCH_DIR the injection gave them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from junitparser import JUnitXml

from distcheck.files.stacks import IDLE_IN_POOL

pytestmark = [pytest.mark.e2e, pytest.mark.ecosystem]

SCRIPTS = Path(__file__).parent / "scripts"
MPTC = SCRIPTS / "mptc"
POOL = SCRIPTS / "pool_suite"
STALL = ("--stall-timeout", "5")
# MultiProcessTestCase imports torch's internal test utilities in every process of every test:
# 30-75 s per test on a 2-core machine at load 15 (measured); the pool suite takes 20-60 s there.
SLOW_S = 600
POOL_S = 300


def _by_test(report: dict) -> dict[str, dict]:
    return {s["test"]: s for s in report["scenarios"] if s.get("test")}


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _pytest(*args: str) -> tuple[str, ...]:
    return ("--", sys.executable, "-m", "pytest", "-q", *args)


MPTC_HEALTHY = ("test_mptc.py::TestCollectives::test_all_reduce", "test_mptc.py::TestCollectives::test_gather_then_destroy")
MPTC_PLANTED = "test_mptc.py::TestCollectives::test_barrier_on_rank0_only"


def _shared_run(tmp_path_factory, name: str, cwd: Path, timeout: float, env: dict, *args: str):
    """One ``distcheck run`` of a suite, for the module's tests to share: (the run, its folder). ``{tmp}`` in
    ``args`` stands for that folder."""
    from conftest import DistcheckRun, command_processes_gone, run_distcheck

    tmp = tmp_path_factory.mktemp(name)
    args = tuple(a.format(tmp=tmp) for a in args)
    done = run_distcheck(["run", *STALL, "--run-dir", str(tmp / "run"), "--json", str(tmp / "report.json"), *args],
                         cwd, tmp / "run", timeout, env=env)
    command_processes_gone(tmp)
    return DistcheckRun(done, tmp / "run", tmp / "report.json"), tmp


@pytest.fixture(scope="module")
def mptc_run(tmp_path_factory):
    """One run of the MultiProcessTestCase suite with its planted rank-0-only barrier: two healthy tests
    and the planted one, each its own generation of processes (the tests below share it)."""
    r, tmp = _shared_run(tmp_path_factory, "mptc", MPTC, SLOW_S, {"PLANT_BARRIER": "1"},
                         "--junit-xml", "{tmp}/junit.xml", *_pytest("test_mptc.py"))
    return r, tmp / "junit.xml"


@pytest.mark.xdist_group("mptc")
@pytest.mark.timeout(SLOW_S + 60)
def test_multiprocess_test_case_healthy_tests_all_run_and_pass(mptc_run):
    r, junit = mptc_run
    report = r.report
    tests = _by_test(report)
    assert len(report["scenarios"]) == 3 and sorted(tests) == sorted(MPTC_HEALTHY + (MPTC_PLANTED,))
    assert all(tests[t]["ok"] and tests[t]["observed"] == ["pass"] for t in MPTC_HEALTHY)
    assert [t for t, s in tests.items() if not s["ok"]] == [MPTC_PLANTED]   # the run fails for it alone
    assert "2 passed" in report["run"]["command_output"]      # pytest's own summary, beside distcheck's
    assert "2 passed" in r.stdout
    [suite] = list(JUnitXml.fromfile(str(junit)))
    assert sorted(c.name for c in suite) == ["test_all_reduce", "test_barrier_on_rank0_only",
                                             "test_gather_then_destroy"]
    dirs = sorted(Path(s["launch_dir"]) for s in tests.values())
    assert len(set(dirs)) == 3 and [d.name for d in dirs[1:]] == ["1", "2"] and dirs[1].parent == dirs[0] / "generations"


@pytest.mark.xdist_group("mptc")
@pytest.mark.timeout(SLOW_S + 60)
def test_multiprocess_test_case_rank0_only_barrier_is_a_hang_on_its_line(mptc_run):
    r, _ = mptc_run
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    tests = _by_test(r.report)
    planted = tests.pop(MPTC_PLANTED)
    assert not planted["ok"] and planted["observed"][0] in ("hang", "mismatch"), planted
    [hang] = [f for f in planted["findings"] if f["kind"] in ("hang", "mismatch")][:1]
    assert hang["op"] == "barrier" and hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["callsite"].endswith(f"test_mptc.py:{_line_of(MPTC / 'test_mptc.py', 'dist.barrier()')}"
                                     ":test_barrier_on_rank0_only")
    assert sorted(tests) == sorted(MPTC_HEALTHY) and all(s["ok"] and s["observed"] == ["pass"]
                                                         for s in tests.values())


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    """One run of the torchmetrics-style pool suite with its planted rank-0-only compute(): two healthy tests
    before it in the same pool, each a generation of its own (the tests below share the run)."""
    return _shared_run(tmp_path_factory, "pool", POOL, POOL_S, {"PLANT_HANG": "1"}, *_pytest())[0]


@pytest.mark.xdist_group("pool")
@pytest.mark.timeout(POOL_S + 60)
def test_pool_suite_in_torchmetrics_style_healthy_tests_before_a_hang_pass(pool_run):
    r = pool_run
    tests = _by_test(r.report)
    assert sorted(tests) == ["test_pool_ddp.py::test_cat", "test_pool_ddp.py::test_rank0_only_compute",
                             "test_pool_ddp.py::test_sum"]
    healthy = ["test_pool_ddp.py::test_cat", "test_pool_ddp.py::test_sum"]
    assert all(tests[t]["ok"] and tests[t]["observed"] == ["pass"] for t in healthy)
    # the hang ends the command (pytest included): test_mean, after it, never runs. A whole healthy pool-style
    # suite passing, exit 0, is test_metrics_reference's torchmetrics-style suite.


@pytest.mark.xdist_group("pool")
@pytest.mark.timeout(POOL_S + 60)
def test_pool_suite_rank0_only_compute_is_named_with_its_test_and_line(pool_run):
    r = pool_run
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    tests = _by_test(r.report)
    planted = tests["test_pool_ddp.py::test_rank0_only_compute"]
    [hang] = [f for f in planted["findings"] if f["kind"] == "hang"]
    line = _line_of(POOL / "test_pool_ddp.py", "m.compute()   # planted")
    assert hang["callsite"].endswith(f"test_pool_ddp.py:{line}:_rank0_compute") and hang["label"] == "SumMetric.compute"
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    [rank1] = [o for o in planted["ranks"] if o["rank"] == 1]
    assert rank1["where"] == IDLE_IN_POOL                  # back in the pool, not running user code
    assert tests["test_pool_ddp.py::test_sum"]["ok"] and tests["test_pool_ddp.py::test_cat"]["ok"]
    assert "test_pool_ddp.py::test_rank0_only_compute: hang" in r.stdout


def test_a_rank_that_exits_with_a_code_from_an_except_block_is_a_crash_naming_what_it_caught(distcheck, no_survivors):
    script = SCRIPTS / "exit_from_except.py"
    r = distcheck("run", *STALL, "--", sys.executable, str(script), timeout=POOL_S)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [rank] = r.report["scenarios"][0]["ranks"]
    assert rank["state"] == "crashed" and rank["exit_code"] == 10
    assert rank["exception"] == "AssertionError: the rank's own check"
    assert rank["where"].endswith(f"exit_from_except.py:{_line_of(script, 'assert 1 + 1')}:<module>")
