"""Pass stays pass on Lightning's suites: each case runs a pytest command twice, from the folder Lightning's CI runs
it from, once plainly and once as ``python -m distcheck run --stall-timeout 30 -- python -m pytest ...`` (default
options otherwise), and requires the same outcome test by test (from a ``--junitxml`` file per run), the same exit
code, no error-level finding where the plain run passed, and no file left in the folder it ran in.

* Lightning's own tests (tests_pytorch, tests_fabric): not in any package, so this part runs only where
  ``DISTCHECK_LIGHTNING_TESTS`` names a Lightning checkout's ``tests/`` folder (a checkout of the installed
  version, or near it). Standalone tests run as Lightning runs them: ``PL_RUN_STANDALONE_TESTS=1``, one test per
  pytest process, which is rank 0 (Lightning's launcher starts rank 1 as the same command again).
* tests/scripts/public/lightning_like/: a project of ours shaped like Lightning's suite (its conftest fails a test
  that leaves a file, a thread, an environment variable, a signal handler or a warning behind), on real Lightning
  from PyPI: one case of each kind runs everywhere (CI), the others with Lightning's own tests.
* A barrier planted on rank 0 of a Lightning DDP run is named where it waits, instead of hanging.
* The harms this lane found are reduced to a few lines of torch in ``tests/test_rule0_command_e2e.py`` (default
  suite).

Every command runs in a session of its own under a hard time limit, and what it started is killed after it. Slow
(each case starts several multi-rank jobs): ``pytest -m public``. Every case prints its times and its table.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import command_processes_gone, kill_everything_below, kill_tree, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.public, pytest.mark.timeout(900)]   # two jobs per case

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "tests" / "scripts" / "public" / "lightning_like"
LIGHTNING_TESTS_ENV = "DISTCHECK_LIGHTNING_TESTS"
RUN_TIMEOUT_S = 300   # one run of a case (the slowest took about 1 minute on 2 busy cores)
DISTCHECK = ("-m", "distcheck", "run", "--stall-timeout", "30", "--")
IGNORED_PARTS = {"__pycache__", ".benchmarks"}   # bytecode, and pytest-benchmark's folder (it makes it plainly too)
LIGHTNING_STANDALONE = {"PL_RUN_STANDALONE_TESTS": "1"}
PROJECT_STANDALONE = {"LIGHTNING_LIKE_STANDALONE": "1"}

# Lightning's own multi-process CPU tests that run in seconds: case -> (folder, environment, node ids). A
# standalone case has one test (one pytest process per standalone test, as Lightning's CI runs them).
LIGHTNING_CASES = {
    "pytorch-spawn": ("tests_pytorch", {}, (
        "strategies/test_ddp_integration.py::test_ddp_cpu",
        "strategies/test_ddp_integration.py::test_ddp_spawn_add_get_queue",
        "trainer/logging_/test_distributed_logging.py::test_all_rank_logging_ddp_cpu",
        "utilities/test_all_gather_grad.py::test_all_gather_ddp_spawn",          # 3 ranks
    )),
    "fabric-spawn-and-fork": ("tests_fabric", {}, (
        "strategies/test_ddp_integration.py::test_ddp_save_load[cpu]",
        "utilities/test_distributed.py::test_collective_operations[devices1-_test_all_reduce]",
        "strategies/launchers/test_multiprocessing_integration.py::test_memory_sharing_disabled[ddp_fork]",
    )),
    "fabric-standalone-clip-gradients": ("tests_fabric", LIGHTNING_STANDALONE, (
        "strategies/test_ddp_integration.py::test_clip_gradients[norm-cpu-32-true]",
    )),
    # a Trainer with DDP on 2 CPUs that never fits: no process group, so distcheck ends with pytest's own code
    "pytorch-standalone-no-process-group": ("tests_pytorch", LIGHTNING_STANDALONE, (
        "trainer/connectors/test_accelerator_connector.py::test_strategy_choice_ddp_on_cpu",
    )),
    "pytorch-standalone-params-synced": ("tests_pytorch", LIGHTNING_STANDALONE, (
        "overrides/test_distributed.py::test_params_synced_during_nonfit",
    )),
    "pytorch-standalone-sampler-without-seed": ("tests_pytorch", LIGHTNING_STANDALONE, (
        "trainer/test_dataloaders.py::test_distributed_sampler_without_global_seed",
    )),
    # one rank, strategy="ddp": DDP's reducer raises in backward, the test expects it
    "pytorch-standalone-unused-parameters": ("tests_pytorch", LIGHTNING_STANDALONE, (
        "strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception",
    )),
    # fails plainly where scikit-learn is not installed (ImportError before any rank): the same failure under
    # distcheck, and pytest's exit code
    "pytorch-standalone-lr-finder": ("tests_pytorch", LIGHTNING_STANDALONE, (
        "tuner/test_lr_finder.py::test_lr_finder_with_ddp",
    )),
}

# The project of ours: case -> (environment, pytest arguments, the tests whose ranks distcheck must have judged
# clean, whether only the full lane runs it). Each run must pass; a command whose tests start no process group must
# end with pytest's own exit code. CI runs one case of each kind (spawned ranks, pytest as rank 0, no process group:
# about 110 s of CPU in all); the full lane (DISTCHECK_LIGHTNING_TESTS set) runs the others too.
FABRIC_SPAWN = "test_fabric_spawn.py::test_fabric_launch_on_two_spawned_ranks"
TRAINER_SPAWN = "test_trainer_spawn.py::test_fit_on_two_spawned_ranks"
TRAINER_DDP = "test_standalone.py::test_trainer_ddp_with_pytest_as_rank_zero"
FABRIC_DDP = "test_standalone.py::test_fabric_ddp_with_pytest_as_rank_zero"
PROJECT_CASES = {
    # Fabric.launch(fn) on spawned ranks, and Trainers that start no process group, in the same command
    "spawn-fabric-and-no-group": ({}, ("test_fabric_spawn.py", "test_no_process_group.py"), (FABRIC_SPAWN,), False),
    "standalone-trainer-ddp": (PROJECT_STANDALONE, (TRAINER_DDP,), (TRAINER_DDP,), False),
    "no-process-group": ({}, ("test_without_a_process_group.py",), (), False),   # the whole command starts none
    "spawn-trainer": ({}, ("test_trainer_spawn.py",), (TRAINER_SPAWN,), True),
    "standalone-fabric-ddp": (PROJECT_STANDALONE, (FABRIC_DDP,), (FABRIC_DDP,), True),
}
FULL_LANE_ONLY = pytest.mark.skipif(not os.environ.get(LIGHTNING_TESTS_ENV),
                                    reason=f"the full lane ({LIGHTNING_TESTS_ENV} set) runs it; CI one case of a kind")


@dataclass(frozen=True)
class Ran:
    code: int
    output: str
    seconds: float
    outcomes: dict[str, list[str]]   # "classname::name" (".rank1" appended for rank 1's own report) -> outcomes
    report: dict                     # distcheck's JSON report ({} plainly, or where it wrote none)


def _tree(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if not IGNORED_PARTS & set(p.relative_to(folder).parts)}


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """(exit code, output, seconds) of a command in a session of its own, with a hard time limit; whatever it
    started is killed after it (a rank outside its session is found by its process tree while it runs). Prints its
    wall time and the CPU time of its processes (on a busy machine the second says more)."""
    t0, cpu0 = time.monotonic(), _children_cpu()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_everything_below(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end in {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        kill_tree(proc)
    left = [] if wait_for(lambda: not _in_session(proc.pid), timeout=10) else _in_session(proc.pid)
    for p in left:
        p.kill()
    assert not left, f"processes of {' '.join(argv)} survived it: {left}"
    seconds = time.monotonic() - t0
    cpu = _children_cpu() - cpu0
    print(f"{seconds:6.1f} s wall, {cpu:6.1f} s CPU, exit {proc.returncode}: {' '.join(argv[1:])[:150]}")
    return proc.returncode, out, seconds


def _children_cpu() -> float:
    """CPU seconds of every process this one waited for, and of those they waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _in_session(sid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if _session(p) == sid]


def _session(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid) if p.status() != psutil.STATUS_ZOMBIE else None
    except (OSError, psutil.Error):
        return None


OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}   # a junit testcase's child -> outcome


def _outcomes(folder: Path) -> dict[str, list[str]]:
    """Each test's outcomes in the junit files of one run (rank 1's, where the project writes its own, apart)."""
    out: dict[str, list[str]] = {}
    for path in sorted(folder.glob("junit.xml*")):
        suffix = path.name.removeprefix("junit.xml")
        for case in ET.parse(path).iter("testcase"):
            kinds = [OUTCOMES[child.tag] for child in case if child.tag in OUTCOMES]
            test = f"{case.get('classname')}::{case.get('name')}{suffix}"
            out.setdefault(test, []).append(kinds[0] if kinds else "passed")
    return out


def _side_by_side(tmp_path: Path, cwd: Path, watched: Path, pytest_args: list[str],
                  env: dict[str, str]) -> tuple[Ran, Ran]:
    """The pytest command plainly, then under distcheck; no file may appear in ``watched`` by either."""
    runs = []
    for mode in ("plain", "distcheck"):
        out = tmp_path / mode
        out.mkdir()
        # Runs go to a folder of this test's (``no_survivors`` finds what they started by it), outside the tree.
        run_env = {**os.environ, **env, "DISTCHECK_RUNS_DIR": str(out / "runs")}
        run_env.pop("PYTEST_CURRENT_TEST", None)   # this test's, not the command's
        command = [sys.executable, "-m", "pytest", "-rA", f"--junitxml={out / 'junit.xml'}", *pytest_args]
        if mode == "distcheck":
            command = [sys.executable, *DISTCHECK, *command]
        before = _tree(watched)
        code, output, seconds = _run(command, cwd, run_env)
        added = sorted(str(p.relative_to(watched)) for p in _tree(watched) - before)
        assert not added, f"{mode}: files appeared in {watched}: {added}"
        reports = sorted((out / "runs").glob("*/report.json"))
        report = json.loads(reports[-1].read_text()) if reports else {}
        runs.append(Ran(code, output, seconds, _outcomes(out), report))
    command_processes_gone(tmp_path)
    plain, under = runs
    print(f"plain {plain.seconds:.1f} s (exit {plain.code}), under distcheck {under.seconds:.1f} s (exit {under.code})")
    print(f"  {'test':100} {'plain':>10} {'distcheck':>10}")
    for test in sorted(plain.outcomes.keys() | under.outcomes.keys()):
        outcomes = ["/".join(run.outcomes.get(test, ["-"])) for run in (plain, under)]
        print(f"  {test:100} {outcomes[0]:>10} {outcomes[1]:>10}")
    return plain, under


def _errors(report: dict) -> list[str]:
    return [f"{f['kind']}: {f['summary'][:300]}" for s in report.get("scenarios", ()) for f in s.get("findings", ())
            if f.get("severity") == "error"]


def _same(plain: Ran, under: Ran) -> None:
    """The same outcome per test and the same exit code, with no error-level finding where the plain run passed."""
    assert plain.outcomes, f"the plain run reported no test (exit {plain.code}):\n{plain.output[-4000:]}"
    assert under.outcomes == plain.outcomes, (
        f"outcomes differ:\n  plain     {plain.outcomes}\n  distcheck {under.outcomes}\n{under.output[-6000:]}")
    assert under.code == plain.code, f"pytest exited {plain.code}, distcheck {under.code}:\n{under.output[-6000:]}"
    if plain.code == 0:
        assert _errors(under.report) == [], _errors(under.report)


@pytest.fixture
def lightning_tests() -> Path:
    where = os.environ.get(LIGHTNING_TESTS_ENV)
    if not where:
        pytest.skip(f"{LIGHTNING_TESTS_ENV} names no Lightning checkout's tests/ folder (they are in no package)")
    tests = Path(where).resolve()
    assert (tests / "tests_pytorch" / "conftest.py").is_file() and (tests / "tests_fabric" / "conftest.py").is_file(), (
        f"{LIGHTNING_TESTS_ENV}={where} is not a Lightning checkout's tests/ folder (tests_pytorch, tests_fabric)")
    return tests


@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightnings_own_tests_have_the_same_outcome_under_distcheck(tmp_path, lightning_tests, case, no_survivors):
    folder, env, node_ids = LIGHTNING_CASES[case]
    # As Lightning's CI: from the suite's own folder, without pytest's cache (it would write into the checkout)
    args = ["-p", "no:cacheprovider", *node_ids]
    plain, under = _side_by_side(tmp_path, lightning_tests / folder, lightning_tests, args, env)
    _same(plain, under)
    assert len(plain.outcomes) == len(node_ids), plain.outcomes


@pytest.mark.parametrize("case", [pytest.param(case, marks=[FULL_LANE_ONLY] if full else [])
                                  for case, (*_, full) in PROJECT_CASES.items()])
def test_a_lightning_shaped_project_has_the_same_outcome_under_distcheck(tmp_path, case, no_survivors):
    env, args, traced, _ = PROJECT_CASES[case]
    plain, under = _side_by_side(tmp_path, PROJECT, PROJECT, list(args), env)
    _same(plain, under)
    assert plain.code == 0, plain.output[-4000:]
    assert all(o in (["passed"], ["skipped"]) for o in plain.outcomes.values()), plain.outcomes
    if case.startswith("standalone"):   # rank 1 (the same pytest command, started by Lightning) reported too
        assert sum(name.endswith(".rank1") for name in plain.outcomes) == 1, plain.outcomes
    judged = {s["name"]: s["ok"] for s in under.report.get("scenarios", ())}
    assert all(judged.get(test) for test in traced), judged   # distcheck did watch those ranks
    if not traced:
        assert "started no process group" in under.output, under.output[-3000:]


PLANTED = '''\
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel


class RankZeroBarrier(BoringModel):
    def on_train_end(self):
        if self.global_rank == 0:
            self.trainer.strategy.barrier()   # planted: rank 1 never calls it


def test_rank_zero_alone_in_a_barrier(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, strategy="ddp_spawn", accelerator="cpu", devices=2, max_steps=1,
                      limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
                      enable_checkpointing=False)
    trainer.fit(RankZeroBarrier())
'''


def test_a_barrier_planted_on_rank_zero_of_a_lightning_run_is_named_where_it_waits(tmp_path, no_survivors):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider -p no:benchmark\n")
    (suite / "conftest.py").write_text('"""Nothing of Lightning\'s tests: a suite of one planted test."""\n')
    test = suite / "test_planted_barrier.py"
    test.write_text(PLANTED)
    line = next(i for i, text in enumerate(PLANTED.splitlines(), 1) if "# planted" in text)
    env = {**os.environ, "DISTCHECK_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("PYTEST_CURRENT_TEST", None)
    code, output, seconds = _run([sys.executable, *DISTCHECK, sys.executable, "-m", "pytest", "-q", test.name],
                                 suite, env)
    print(f"under distcheck {seconds:.1f} s (exit {code})")
    assert code == 1, output[-4000:]
    [report] = (tmp_path / "runs").glob("*/report.json")
    [scenario] = json.loads(report.read_text())["scenarios"]
    hangs = [f for f in scenario["findings"] if f["kind"] == "hang"]
    assert hangs, output[-4000:]
    print(f"{scenario['name']}: {scenario['observed']}; {hangs[0]['summary']}")
    assert hangs[0]["waiting_ranks"] == [0] and hangs[0]["absent_ranks"] == [1], hangs[0]
    assert "waiting in barrier" in hangs[0]["summary"] and "rank 1 never entered it" in hangs[0]["summary"], hangs[0]
    file, at, function = hangs[0]["callsite"].split(":")
    assert (Path(file).name, int(at), function) == (test.name, line, "on_train_end"), hangs[0]
    print(f"stall onset to verdict: {scenario['detected_at'] - scenario['stall_onset']:.1f} s")
    assert scenario["detected_at"] - scenario["stall_onset"] < 10   # a certain hang: no --stall-timeout's 30 s
    assert sorted(p.name for p in suite.iterdir() if p.name not in IGNORED_PARTS) == ["conftest.py", "pytest.ini",
                                                                                      test.name]
