"""Library shapes on real gloo ranks (issue 30): gloo's monitored_barrier, accelerate's own data-loop
test under site-packages. Each case: kind, ranks and line, or clean."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from load import cpu_hogs

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts" / "ecosystem"
MONITORED = SCRIPTS / "monitored_barrier.py"
ACCELERATE = ("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--mixed_precision", "no",
              "--num_machines", "1", "--dynamo_backend", "no")
CPU = {"ACCELERATE_USE_CPU": "1"}


def _line_of(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if f"# {marker}" in line)


def _errors(report: dict) -> list[dict]:
    [s] = report["scenarios"]
    return [f for f in s["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize("hogs", [0, 2], ids=["quiet", "beside-cpu-hogs"])
def test_a_late_rank_at_monitored_barrier_is_no_mismatch(distcheck, hogs):
    with cpu_hogs(hogs):
        r = distcheck("run", str(MONITORED), "--nproc-per-node", "3", "--stall-timeout", "30", "--",
                      "--late", "2", "--late-s", "6", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert _errors(r.report) == []


def test_a_rank_that_skips_monitored_barrier_is_named(distcheck):
    r = distcheck("run", str(MONITORED), "--nproc-per-node", "3", "--stall-timeout", "10", "--", "--skip", "1",
                  timeout=180)
    assert r.returncode == 1, r.stdout[-3000:]
    # two ranks in monitored_barrier against one in the next all_reduce: rank 1 is the odd one out, at its line
    [odd] = _errors(r.report)
    assert odd["kind"] == "mismatch" and odd["odd_ranks"] == [1] and "op" in odd["fields"]
    assert odd["callsite"].startswith(f"{MONITORED}:{_line_of(MONITORED, 'MONITORED')}:")
    lines = {d["rank"]: d["callsite"] for d in odd["ranks"]}
    assert lines[1].startswith(f"{MONITORED}:{_line_of(MONITORED, 'AFTER')}:")


def test_accelerates_data_loop_test_under_site_packages_is_a_hang_at_its_own_lines(distcheck):
    import accelerate
    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_distributed_data_loop.py"
    r = distcheck("run", "--stall-timeout", "20", "--", *ACCELERATE, str(script), env=CPU, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:]
    hangs = [f for f in _errors(r.report) if f["kind"] == "hang"]
    assert [h["waiting_ranks"] for h in hangs] == [[1]] and hangs[0]["absent_ranks"] == [0]
    [hang] = hangs
    assert hang["op"] == "barrier" and hang["callsite"].startswith(str(script) + ":")
    lines = {d["rank"]: d["callsite"] for d in hang["ranks"]}
    assert lines[0].startswith(str(script) + ":") and lines[0] != lines[1]   # DDP's broadcast, at the script's line
    assert not [f for f in _errors(r.report) if f["kind"] == "mismatch"]


@pytest.mark.parametrize("raises", [True, False], ids=["raises", "healthy-twin"])
def test_an_exception_after_end_training_is_the_ranks_own_failure(distcheck, raises):
    """accelerate's ``end_training()`` destroys the process group in a ``finally:``; the KeyError that follows
    on both ranks is theirs, at its line (not "something outside the ranks"). The command is timed from its
    start."""
    script = SCRIPTS / "end_training_raises.py"
    r = distcheck("run", "--stall-timeout", "20", "--", *ACCELERATE, str(script), *([] if raises else ["--no-raise"]),
                  env=CPU, timeout=300)
    [s] = r.report["scenarios"]
    assert s["script"] and s["duration_s"] >= 0.6 * r.report["run"]["duration_s"], (s["duration_s"], r.report["run"])
    if not raises:
        assert r.returncode == 0 and _errors(r.report) == [], r.stdout[-3000:]
        return
    assert r.returncode == 1, r.stdout[-3000:]
    [crash] = _errors(r.report)
    assert crash["kind"] == "crash" and "outside the ranks" not in crash["summary"], crash["summary"]
    assert "KeyError: 'learning_rate'" in crash["summary"] and "rank 1 failed the same way" in crash["summary"]
    assert crash["callsite"].startswith(f"{script}:{_line_of(script, 'RAISES')}:")
    assert {d["rank"]: d["state"] for d in s["ranks"]} == {0: "crashed", 1: "crashed"}
