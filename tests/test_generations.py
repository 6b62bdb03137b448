"""Issue 25, quick lane: generations of a command's ranks and one verdict per pytest test.

The pure parts (how a generation is agreed on a real c10d store, when the watch of a generation
or of the command ends, how generations' verdicts merge per test, the honest endings, the idle
pool worker, the renderers' per-test output) on hand-built values; the end-to-end runs are in
test_generations_e2e.py.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch.distributed as dist
from junitparser import Failure, JUnitXml
from rich.console import Console

from distcheck.diagnose.common import RunFacts
from distcheck.diagnose.verdict import (Scenario, command_ended, ended_by_distcheck, merge_results,
                                       unexplained_failure)
from distcheck.files.launch_dir import LaunchFiles
from distcheck.files.stacks import IDLE_IN_POOL, StackFrame, idle_in_pool
from distcheck.launch.command import CommandQuiet
from distcheck.launch.progress import RankProgress
from distcheck.launch.watchdog import generation_over
from distcheck.models import EndReason, Finding, Kind, Phase, RankOutcome, Report, RunInfo, ScenarioResult, Severity
from distcheck.rank import injected
from distcheck.report import junit, terminal


# -- the launch dir: generations and the current test --


def test_generation_zero_keeps_the_launch_dirs_layout_and_later_ones_get_their_own(tmp_path):
    files = LaunchFiles(tmp_path)
    assert [files.claim_generation() for _ in range(3)] == [0, 1, 2]
    assert files.generations() == [0, 1, 2]
    assert files.generation(0).root == tmp_path
    assert files.generation(2).trace(1) == tmp_path / "generations" / "2" / "traces" / "rank1.trace"


def test_claims_from_many_threads_never_share_a_generation(tmp_path):
    files, got, lock = LaunchFiles(tmp_path), [], threading.Lock()

    def claim() -> None:
        index = files.claim_generation()
        with lock:
            got.append(index)

    threads = [threading.Thread(target=claim) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(16))


def test_a_rank_takes_its_test_from_the_pytest_process_above_it_before_its_environment(tmp_path, monkeypatch):
    files = LaunchFiles(tmp_path)
    monkeypatch.setenv(injected.PYTEST_TEST_ENV, "test_x.py::test_old (call)")   # as old as a pool
    assert injected.current_test(files) == "test_x.py::test_old"
    files.write_current_test(injected._ancestors()[0], "test_x.py::test_now")
    assert injected.current_test(files) == "test_x.py::test_now"
    files.write_current_test(injected._ancestors()[0], None)   # between tests: the environment again
    assert injected.current_test(files) == "test_x.py::test_old"


# -- agreeing on a generation through the job's own store --


def _arrive(store, files, world, out, lock):
    index = injected.generation_on(store, files, world, wait_s=30)
    with lock:
        out.append(index)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_of_one_init_agree_on_their_generation_and_the_next_init_gets_the_next(tmp_path, world):
    """Two inits on one store (a job that re-uses it), every rank a thread: each init's ranks
    share one generation, and the two differ."""
    store, files, lock = dist.HashStore(), LaunchFiles(tmp_path), threading.Lock()
    seen = []
    for _ in range(2):
        out: list[int] = []
        threads = [threading.Thread(target=_arrive, args=(store, files, world, out, lock)) for _ in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(out)) == 1, out
        seen.append(out[0])
    assert seen == [0, 1]


def test_a_fresh_store_on_the_same_address_still_gets_a_new_generation(tmp_path):
    """A pool that re-inits on one port gets a new TCPStore each time: its counter starts again,
    the launch dir's claim does not."""
    files = LaunchFiles(tmp_path)
    first = injected.generation_on(dist.HashStore(), files, 1)
    second = injected.generation_on(dist.HashStore(), files, 1)
    assert (first, second) == (0, 1)


# -- when a watch ends --


def test_a_generation_is_over_when_every_rank_was_seen_and_none_is_alive():
    gone = RankProgress(phase=Phase.FINISHED, alive=False)
    assert generation_over({0: gone, 1: gone}, 2)
    assert not generation_over({0: gone}, 2)   # rank 1 not seen yet: still starting
    assert not generation_over({0: gone, 1: RankProgress(phase=Phase.RUNNING)}, 2)


def test_a_command_is_quiet_only_after_no_cpu_for_the_stall_timeout():
    quiet = CommandQuiet(stall_timeout=5.0)
    assert not quiet.observe(0.0, {10: 1.0})
    assert not quiet.observe(4.0, {10: 1.0})
    assert quiet.observe(5.5, {10: 1.05})          # 0.05 s of CPU in 5.5 s: quiet
    quiet = CommandQuiet(stall_timeout=5.0)
    quiet.observe(0.0, {10: 1.0})
    assert not quiet.observe(5.5, {10: 1.0, 11: 2.0})   # a new process used CPU: progress
    assert not quiet.observe(10.0, {10: 1.0, 11: 2.0})  # counted from that progress
    assert quiet.observe(11.0, {10: 1.0, 11: 2.0})


# -- verdicts --


def _result(name, ok=True, findings=(), test=None, end=EndReason.COMPLETED):
    return ScenarioResult(name=name, source="python -m pytest", expected=("pass",),
                          observed=tuple(f.kind for f in findings) or ("pass",), ok=ok, duration_s=1.0,
                          findings=tuple(findings), end_reason=end, test=test, script=True,
                          ranks=(RankOutcome(rank=0, state="finished"),))


HANG = Finding(kind=Kind.HANG, severity=Severity.ERROR, summary="Rank 0 is waiting in barrier #1", op="barrier", seq=1)


def test_a_run_distcheck_ended_is_never_a_pass_even_with_nothing_open():
    stalled = RunFacts(world_size=2, end_reason=EndReason.STALL, stall_timeout_s=5)
    [f] = ended_by_distcheck(stalled, [])
    assert f.kind == "hang" and f.severity == "error" and "distcheck ended this run itself" in f.summary
    assert ended_by_distcheck(stalled, [HANG]) == []     # the hang already says why
    assert ended_by_distcheck(RunFacts(world_size=2), []) == []


def test_a_run_that_lost_a_node_with_its_ranks_records_is_never_a_pass_however_it_ended():
    # Node 1 went away before its ranks entered the all_reduce: ranks 0 and 1 failed in it ("Connection
    # closed by peer", a reaction), the launch ended as a crash, and no record says what ranks 2 and 3 did.
    crashed = RunFacts(world_size=4, end_reason=EndReason.CRASH, records_lost=(2, 3))
    why = "the records of ranks 2, 3 went with their lost node"
    [f] = ended_by_distcheck(crashed, [], why)
    assert f.kind == "crash" and f.severity == "error" and why in f.summary and "a rank crashed" in f.summary
    assert not f.waiting_ranks and not f.absent_ranks
    assert ended_by_distcheck(crashed, [HANG], why) == []     # a finding already says why
    assert ended_by_distcheck(RunFacts(world_size=4, end_reason=EndReason.CRASH), []) == []   # nothing lost


def test_a_run_that_ended_because_a_rank_failed_is_never_a_pass_though_no_record_explains_it():
    crashed = RunFacts(world_size=2, end_reason=EndReason.CRASH)
    outcomes = {0: RankOutcome(rank=0, state="killed", exit_code=1, exception="DistStoreError: wait timeout"),
                1: RankOutcome(rank=1, state="finished", exit_code=0)}
    [f] = unexplained_failure(crashed, outcomes, [])
    assert f.kind == "crash" and f.severity == "error" and f.odd_ranks == (0,)
    assert "Rank 0 exited with code 1 (DistStoreError: wait timeout)" in f.summary and "did not pass" in f.summary
    assert unexplained_failure(crashed, outcomes, [HANG]) == []                     # a finding already says why
    assert unexplained_failure(RunFacts(world_size=2, end_reason=EndReason.COMPLETED), outcomes, []) == []
    stopped = {0: RankOutcome(rank=0, state="killed", signal="SIGTERM"),           # the launcher's, after
               1: RankOutcome(rank=1, state="killed", signal="SIGSEGV")}
    [f] = unexplained_failure(crashed, stopped, [])
    assert f.odd_ranks == (1,) and "was killed by SIGSEGV" in f.summary


def test_generations_of_one_test_merge_into_one_verdict():
    merged = merge_results([_result("t"), _result("t", ok=False, findings=[HANG], end=EndReason.STALL)])
    assert not merged.ok and merged.observed == ("hang",) and merged.end_reason == EndReason.STALL
    assert merged.duration_s == 2.0 and "2 generations" in merged.description


def test_the_command_gets_a_verdict_of_its_own_only_where_nothing_else_explains_its_end():
    scenario = Scenario(name="pytest", source="python -m pytest")
    args = dict(started_at=0.0, ended_at=1.0)
    assert command_ended(scenario, EndReason.COMPLETED, 0, None, explained=False, **args) is None
    assert command_ended(scenario, EndReason.COMPLETED, 1, None, explained=True, **args) is None
    failed = command_ended(scenario, EndReason.COMPLETED, 1, None, explained=False, **args)
    assert not failed.ok and failed.observed == ("crash",) and "exited with code 1" in failed.findings[0].summary
    ended = command_ended(scenario, EndReason.STALL, None, "it made no progress", explained=True, **args)
    assert not ended.ok and "it made no progress" in ended.findings[0].summary


# -- where a rank is --


def _frames(*spec):
    return [StackFrame(file=f, line=n, function=fn) for f, n, fn in spec]


def test_a_pool_worker_between_tasks_is_idle_not_running_user_code():
    idle = _frames(("/usr/lib/python3.11/multiprocessing/connection.py", 395, "_recv"),
                   ("/usr/lib/python3.11/multiprocessing/connection.py", 216, "recv_bytes"),
                   ("/usr/lib/python3.11/multiprocessing/queues.py", 389, "get"),
                   ("/usr/lib/python3.11/multiprocessing/pool.py", 114, "worker"),
                   ("/usr/lib/python3.11/multiprocessing/process.py", 108, "run"))
    busy = _frames(("/home/u/test_x.py", 12, "_task"),
                   ("/usr/lib/python3.11/multiprocessing/pool.py", 125, "worker"))
    assert idle_in_pool(idle) and not idle_in_pool(busy) and not idle_in_pool([])


# -- renderers: one verdict per test, and the command's own last lines --


def _report():
    run = RunInfo(backend="gloo", world_size=2, nnodes=1, nproc_per_node=2, torch_version="2.13", distcheck_version="0",
                  command="distcheck run -- python -m pytest", run_dir="/tmp/r", seed=0, duration_s=3.0,
                  started_at="2026-01-01T00:00:00", command_output="=== 1 failed, 2 passed in 9.1s ===")
    return Report(run=run, scenarios=(
        _result("a", test="tests/test_mp.py::TestA::test_ok"),
        _result("b", ok=False, findings=[HANG], test="tests/test_mp.py::TestA::test_barrier[2]", end=EndReason.STALL),
        _result("c", test="tests/test_mp.py::test_plain"),
    ))


def test_junit_has_one_testcase_per_test_named_as_pytest_names_it(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(junit.render(_report()))
    [suite] = list(JUnitXml.fromfile(str(path)))
    cases = {(c.classname, c.name): c for c in suite}
    assert set(cases) == {("tests.test_mp.TestA", "test_ok"), ("tests.test_mp.TestA", "test_barrier[2]"),
                          ("tests.test_mp", "test_plain")}
    [failure] = cases[("tests.test_mp.TestA", "test_barrier[2]")].result
    assert isinstance(failure, Failure) and "waiting in barrier" in failure.message
    assert "1 failed, 2 passed" in path.read_text()


def test_terminal_names_each_test_and_shows_the_commands_summary_beside_the_verdict():
    console = Console(file=io.StringIO(), width=120, color_system=None)
    terminal.render(_report(), console)
    out = console.file.getvalue()
    assert "tests/test_mp.py::TestA::test_barrier[2]: hang" in out
    assert "1 failed, 2 passed" in out and "2/3 tests' ranks ran clean" in out


def test_the_test_round_trips_through_json():
    report = _report()
    assert Report.from_dict(report.to_dict()) == report
    assert [s["test"] for s in report.to_dict()["scenarios"]][1] == "tests/test_mp.py::TestA::test_barrier[2]"
    assert IDLE_IN_POOL.startswith("idle")
