"""The pytest plugin, through pytester: marked tests run on real gloo ranks under distcheck.

Each test runs pytest in a subprocess (the plugin loads from its ``pytest11`` entry point)
with a hard timeout, and checks afterwards that no rank outlived it.
"""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET

import pytest

from conftest import survivors, wait_for

pytest_plugins = ("pytester",)

MODULE = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(nproc=2)
def test_healthy(dist_ctx):
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.distributed(nproc=2)
def test_hangs(dist_ctx):
    from torchmetrics.classification import BinaryAUROC

    metric = BinaryAUROC()
    metric.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
    if dist_ctx.rank == 0:
        metric.compute()   # HANG LINE


@pytest.mark.distributed(nproc=2)
def test_mismatch(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if dist_ctx.rank == 0 else dist.ReduceOp.MAX)


@pytest.mark.distributed(nproc=2)
def test_rank_assert(dist_ctx):
    assert dist_ctx.rank == 0, f"rank {dist_ctx.rank} disagrees"


@pytest.mark.distributed(nproc=2)
def test_wants_a_fixture(dist_ctx, tmp_path):
    pass
'''


def run_pytest(pytester: pytest.Pytester, *args: str, timeout: float = 240) -> pytest.RunResult:
    run_dir = pytester.path / "runs"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--distcheck-run-dir", str(run_dir),
                                           *args, timeout=timeout)
    left = survivors(str(run_dir))
    for p in left:
        p.kill()
    assert not left, f"ranks survived pytest: {[p.info['cmdline'] for p in left]}"
    return result


def failures(junit: str) -> dict[str, str | None]:
    """testcase name -> its failure text (None: it passed)."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        out[case.get("name")] = None if failure is None else (failure.get("message", "") + (failure.text or ""))
    return out


@pytest.mark.e2e
@pytest.mark.timeout(270)
def test_a_hang_fails_with_the_diagnosis_and_the_other_tests_still_run(pytester):
    path = pytester.makepyfile(test_dist=MODULE)
    hang_line = path.read_text().splitlines().index("        metric.compute()   # HANG LINE") + 1
    junit = str(pytester.path / "junit.xml")
    started = time.monotonic()
    result = run_pytest(pytester, str(path), "--distcheck-stall-timeout", "3", f"--junitxml={junit}")
    took = time.monotonic() - started
    result.assert_outcomes(passed=1, failed=4)
    text = failures(junit)
    assert text["test_healthy"] is None
    hang = " ".join(text["test_hangs"].split())   # the diagnosis is wrapped at 120 columns
    assert "observed hang" in hang and "Rank 0 is waiting in" in hang
    assert f"BinaryAUROC.compute at test_dist.py:{hang_line}" in hang and "rank 1 never entered it" in hang
    assert "reduce_op SUM on rank 0 vs MAX on rank 1" in text["test_mismatch"]
    # The assert of the next test in the same launch is that test's, not the mismatch's.
    assert "AssertionError" not in text["test_mismatch"]
    rank_assert = text["test_rank_assert"]
    assert rank_assert.startswith("Failed: rank 1: AssertionError: rank 1 disagrees")
    assert 'test_dist.py", line' in rank_assert and "/shims/" not in rank_assert.split("\n\n")[0]
    assert "tmp_path would be a fixture of the pytest process" in text["test_wants_a_fixture"]
    # Every test names its run dir (a JUnit property, for CI artifacts).
    props = [p.get("value") for p in ET.parse(junit).getroot().iter("property") if p.get("name") == "distcheck_run_dir"]
    assert len(props) == 4 and all("/runs/" in p for p in props)
    # The shared launch is ended by the hang; the two tests after it run again, in one launch.
    summary = [line for line in result.outlines if line.startswith("distcheck: ")]
    assert summary and "5 distributed test(s) in 2 launch(es)" in summary[0], result.outlines[-10:]
    # torch's own log lines (torchelastic's agent and rendezvous) went to the launches' logs, not the report
    assert not [line for line in result.outlines if any(
        name in line for name in ("torch.distributed.elastic", "torchelastic", "torch.multiprocessing", "spawn.py:"))]
    print(f"\n{summary[0]}; pytest took {took:.1f} s")


SHARED = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(nproc=2)
def test_all_reduce(dist_ctx):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t[0] == 2


@pytest.mark.distributed(nproc=2)
def test_rank0_only(dist_ctx):
    dist.all_reduce(torch.ones(2))
    if dist_ctx.rank == 0:
        dist.barrier()   # HANG LINE
'''


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_certain_hang_in_a_shared_launch_is_named_at_once_on_the_failed_line(pytester):
    """Two tests in one launch; rank 1 is past the second (it waits for rank 0 at the test's end, through the
    store) while rank 0 waits in a barrier: a certain hang, named well before the stall timeout (30 s here),
    and pytest's FAILED line says it."""
    path = pytester.makepyfile(test_x=SHARED)
    line = path.read_text().splitlines().index("        dist.barrier()   # HANG LINE") + 1
    junit = str(pytester.path / "junit.xml")
    result = run_pytest(pytester, str(path), "--distcheck-stall-timeout", "30", f"--junitxml={junit}", "-rf",
                        timeout=150)
    result.assert_outcomes(passed=1, failed=1)
    summary = [x for x in result.outlines if x.startswith("distcheck: ")]
    assert summary and "2 distributed test(s) in 1 launch(es)" in summary[0], result.outlines[-10:]
    text = failures(junit)["test_rank0_only"]
    assert text.startswith(f"Failed: hang: rank 0 in barrier at test_x.py:{line}; rank 1 never entered"), text
    detected = re.search(r"detected (\d+\.\d) s after the last progress", text)
    assert detected and float(detected[1]) <= 1.0, text
    assert "Decided: certain: rank 1 finished" in " ".join(text.split())
    failed = [x for x in result.outlines if x.startswith("FAILED ")]
    assert failed and "hang: rank 0 in barrier" in failed[0], result.outlines[-5:]


SMALL = '''
import pytest
import torch
import torch.distributed as dist

{tests}

@pytest.mark.distributed(nproc=[2, 4])
def test_both_sizes(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist_ctx.world_size
'''

ONE = '''
@pytest.mark.distributed(nproc=4)
def test_small_{i}(dist_ctx):
    t = torch.full((2,), float(dist_ctx.rank))
    dist.all_reduce(t)
    assert t.tolist() == [6.0, 6.0]
'''


@pytest.mark.e2e
@pytest.mark.timeout(270)
def test_twenty_small_tests_at_four_ranks_share_one_launch(pytester):
    path = pytester.makepyfile(test_small=SMALL.format(tests="".join(ONE.format(i=i) for i in range(20))))
    started = time.monotonic()
    result = run_pytest(pytester, str(path), "-v")
    took = time.monotonic() - started
    result.assert_outcomes(passed=22)
    assert "test_small.py::test_both_sizes[nproc2] PASSED" in result.outlines[-30:] or \
        any("test_both_sizes[nproc2] PASSED" in line for line in result.outlines)
    [summary] = [line for line in result.outlines if line.startswith("distcheck: ")]
    launches = int(re.search(r"in (\d+) launch", summary).group(1))
    assert launches == 2, summary   # the 21 four-rank tests in one launch, the two-rank variant in another
    print(f"\n{summary}; pytest took {took:.1f} s")


def test_dist_ctx_outside_a_distributed_test_is_a_clear_failure(pytester):
    pytester.makepyfile(test_plain="def test_plain(dist_ctx):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*dist_ctx exists only in @pytest.mark.distributed tests*"])


WORLD_CONFTEST = '''
import os, signal, threading, warnings
from pathlib import Path
import pytest

@pytest.fixture(autouse=True)
def the_same_world_after_every_test():
    """What a suite's own checks look at after each test (Lightning's thread police, its artifact and environment
    checks): the plugin runs its launches in this very process, and must leave it as it found it."""
    root = Path(__file__).parent
    threads = set(threading.enumerate())
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    files = {p for p in root.rglob("*") if "__pycache__" not in p.parts}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [t for t in set(threading.enumerate()) - threads if t.is_alive()], "threads left"
    now = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert now == env, sorted(set(now.items()) ^ set(env.items()))
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "signal handlers changed"
    assert not {p for p in root.rglob("*") if "__pycache__" not in p.parts} - files, "files left"
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
'''

WORLD_TESTS = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(nproc=2)
def test_all_reduce(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

def test_plain():
    assert True
'''


@pytest.mark.e2e
@pytest.mark.timeout(270)
def test_the_plugin_leaves_the_pytest_process_as_it_found_it(pytester):
    """Threads, environment variables, signal handlers, files under the suite and warnings: the same after a
    distributed test as before it (torch's launcher sets TORCHELASTIC_SIGNALS_TO_HANDLE in the process that calls
    it; the run dir is outside the suite)."""
    pytester.makeconftest(WORLD_CONFTEST)
    path = pytester.makepyfile(test_world=WORLD_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", str(path), timeout=240)
    result.assert_outcomes(passed=2)
    # the fork server's multiprocessing helper (its command line names the suite's folder in its sys.path) ends
    # once the pytest that started it is gone: given a moment, nothing is left
    assert wait_for(lambda: not survivors(str(pytester.path)), timeout=15), \
        [p.info["cmdline"] for p in survivors(str(pytester.path))]


TEARDOWN_MODULE = """
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(nproc=2)
def test_sigterm_handler(dist_ctx):
    if dist.get_rank() == 0:
        def on_sigterm(signum, frame):
            dist.broadcast(torch.ones(1), src=0)   # HANDLER LINE
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_sigterm)
        time.sleep(3600)   # ASLEEP LINE
    else:
        dist.barrier()   # BARRIER LINE
"""


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_sigterm_handler_that_issues_a_collective_in_the_teardown_changes_nothing(pytester):
    """The plugin ends the launch as distcheck run does: rank 0's own SIGTERM handler then issues a broadcast; the
    test fails with the hang as it was decided (tests/test_teardown_e2e.py for run and the Slurm tests for srun)."""
    path = pytester.makepyfile(test_teardown=TEARDOWN_MODULE)
    lines = path.read_text().splitlines()
    barrier = next(i for i, line in enumerate(lines, 1) if "# BARRIER LINE" in line)
    asleep = next(i for i, line in enumerate(lines, 1) if "# ASLEEP LINE" in line)
    junit = str(pytester.path / "junit.xml")
    result = run_pytest(pytester, str(path), "--distcheck-stall-timeout", "3", f"--junitxml={junit}")
    result.assert_outcomes(failed=1)
    text = " ".join(failures(junit)["test_sigterm_handler"].split())
    hang = text[text.index("Rank 1 is waiting in"):]
    hang = hang[:hang.index(". ")]
    assert f"test_teardown.py:{barrier}" in hang and "rank 0 never entered it" in hang, text
    assert f"test_teardown.py:{asleep}" in hang and "broadcast" not in hang, text
