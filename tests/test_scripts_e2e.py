"""Pre-flight on users' own scripts (issue 4): torchrun-style scripts and Lightning under distcheck."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import findings_less_torch_notes

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts"
RANK0_COMPUTE = SCRIPTS / "rank0_compute.py"
LIGHTNING_VAL = SCRIPTS / "lightning_val.py"
TIMEOUT_BUSY = SCRIPTS / "timeout_busy.py"


def _only(report: dict) -> dict:
    [s] = report["scenarios"]
    return s


def test_script_with_rank0_only_compute_is_a_hang_on_the_scripts_own_line(distcheck):
    r = distcheck("run", str(RANK0_COMPUTE), "--nproc-per-node", "2", "--stall-timeout", "4", "--", "--steps", "12")
    assert r.returncode == 1, r.stderr[-2000:]
    s = _only(r.report)
    assert s["name"] == "rank0_compute" and s["source"] == str(RANK0_COMPUTE)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["label"] == "BinaryAUROC.compute"
    file, line, _ = hang["callsite"].split(":")
    assert file == str(RANK0_COMPUTE)
    assert "metric.compute()" in RANK0_COMPUTE.read_text().splitlines()[int(line) - 1]
    launch = Path(s["launch_dir"])
    assert (launch / "logs" / "rank0.log").read_text().count("rank 0 evaluating") == 1   # the script's own output is kept


def test_healthy_script_under_max_duration_is_clean_with_its_collective_count(distcheck):
    r = distcheck("run", str(RANK0_COMPUTE), "--nproc-per-node", "2", "--max-duration", "8",
                  "--", "--fixed", "--forever", "--compute-at", "3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert s["ok"] and s["end_reason"] == "max_duration" and s["findings"] == []
    assert s["collectives_compared"] > 10
    assert all(x["state"] == "running" for x in s["ranks"])
    assert "clean" in r.stdout


def test_script_that_finishes_early_ends_the_run_normally(distcheck):
    r = distcheck("run", str(RANK0_COMPUTE), "--nproc-per-node", "2", "--max-duration", "120",
                  "--", "--fixed", "--steps", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    s = _only(r.report)
    assert s["end_reason"] == "completed" and s["duration_s"] < 60


def test_module_mode_runs_python_dash_m(distcheck):
    r = distcheck("run", "-m", "rank0_compute", "--nproc-per-node", "2", "--", "--fixed", "--steps", "4",
                  env={"PYTHONPATH": str(SCRIPTS)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert _only(r.report)["collectives_compared"] > 0


def test_a_script_that_never_initializes_a_process_group_is_a_clear_error(distcheck, tmp_path):
    script = tmp_path / "not_distributed.py"
    script.write_text("print('hello')\n")
    r = distcheck("run", str(script), "--nproc-per-node", "2", json=False)
    assert r.returncode == 2
    assert "without calling init_process_group" in r.stderr and "Traceback" not in r.stderr


def _line_of(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if f"# {marker}" in line)


def _timed_out_hang(distcheck, flag: str) -> dict:
    r = distcheck("run", str(TIMEOUT_BUSY), "--nproc-per-node", "3", "--stall-timeout", "60", "--timeout", "8",
                  "--", flag, timeout=120)
    assert r.returncode == 4, r.stderr[-2000:]
    s = _only(r.report)
    assert s["end_reason"] == "timeout"
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    return hang


def test_a_rank_busy_in_user_code_at_the_timeout_is_absent_with_its_line(distcheck):
    hang = _timed_out_hang(distcheck, "--busy")
    assert hang["waiting_ranks"] == [] and hang["absent_ranks"] == [1]
    busy = f"{TIMEOUT_BUSY}:{_line_of(TIMEOUT_BUSY, 'BUSY')}"
    [rank1] = hang["ranks"]
    assert rank1["role"] == "absent" and rank1["where"].startswith(busy + ":")
    assert f"rank 1 running outside any collective at {busy}" in hang["summary"]
    assert "ranks 0, 2 finished" in hang["summary"]


def test_a_barrier_alone_is_named_at_once_with_the_waiting_and_absent_sides(distcheck):
    # ranks 1 and 2 finished: a certain hang, named at once, long before the --timeout of 8 s
    r = distcheck("run", str(TIMEOUT_BUSY), "--nproc-per-node", "3", "--stall-timeout", "60", "--timeout", "8",
                  "--", "--alone", timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    s = _only(r.report)
    assert s["end_reason"] == "certain_hang"
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["detected_after_s"] < 2 and "certain: ranks 1, 2 finished" in hang["summary"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2]
    assert (hang["op"], hang["seq"]) == ("barrier", 2)
    assert hang["callsite"].startswith(f"{TIMEOUT_BUSY}:{_line_of(TIMEOUT_BUSY, 'ALONE')}:")
    assert "ranks 1, 2 never entered it (finished, now idle)" in hang["summary"]

@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_ddp_validation_runs_clean_without_double_spawning(distcheck):
    r = distcheck("run", str(LIGHTNING_VAL), "--nproc-per-node", "2", "--stall-timeout", "8", "--", "--devices", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = _only(r.report)
    assert findings_less_torch_notes(s) == [] and s["collectives_compared"] > 0
    # one worker per rank: Lightning saw torchelastic's environment and did not spawn its own
    assert [x["rank"] for x in s["ranks"]] == [0, 1]
    assert len({x["pid"] for x in s["ranks"]}) == 2


@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_rank0_only_self_log_is_diagnosed(distcheck):
    r = distcheck("run", str(LIGHTNING_VAL), "--nproc-per-node", "2", "--stall-timeout", "5",
                  "--", "--devices", "2", "--rank0-log")
    assert r.returncode == 1
    s = _only(r.report)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["op"] in ("barrier", "all_reduce", "all_gather")
    file, line, _ = hang["callsite"].split(":")
    assert file == str(LIGHTNING_VAL)
    assert 'self.log("rank0_loss"' in LIGHTNING_VAL.read_text().splitlines()[int(line) - 1]


@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_rank0_only_self_log_dict_is_attributed_to_the_log_dict_line(distcheck):
    # log_dict calls self.log per key from Lightning's own frame: the user's log_dict line must win.
    r = distcheck("run", str(LIGHTNING_VAL), "--nproc-per-node", "2", "--stall-timeout", "5",
                  "--", "--devices", "2", "--rank0-log-dict")
    assert r.returncode == 1
    s = _only(r.report)
    [hang] = [f for f in s["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    assert hang["op"] in ("barrier", "all_reduce", "all_gather")
    file, line, function = hang["callsite"].split(":")
    assert (file, function) == (str(LIGHTNING_VAL), "validation_step")
    assert "self.log_dict({" in LIGHTNING_VAL.read_text().splitlines()[int(line) - 1]

@pytest.mark.ecosystem   # real Lightning in the ranks: the ecosystem lane
def test_lightning_validation_of_10_samples_on_4_ranks_reports_the_2_padded_duplicates(distcheck):
    r = distcheck("run", str(LIGHTNING_VAL), "--nproc-per-node", "4", "--stall-timeout", "8",
                  "--", "--devices", "4", "--samples", "10")
    s = _only(r.report)
    [dup] = [f for f in s["findings"] if f["kind"] == "duplicates"]
    assert dup["data"]["dataset_size"] == 10 and dup["data"]["extra"] == 2
    assert sorted(dup["data"]["duplicated"]) == ["0", "1"]
    assert "padded 10 samples to 12 for 4 ranks" in dup["summary"]
    assert r.returncode == 1


STORE_WAIT_ALONE = SCRIPTS / "store_wait_alone.py"


@pytest.mark.parametrize("how", ["script", "torchrun"])
def test_a_rank_that_fails_outside_any_collective_after_its_peers_finished_is_a_crash(distcheck, how):
    # Rank 0's store wait times out ("wait timeout": worded like a reaction to a lost peer), outside any
    # collective, once rank 1 finished: nothing else explains its exit code 1, so it is the job's failure.
    # That read as PASS (rank 0 "killed", no finding), as did rank 0 failing in init_process_group when its
    # peers left while it was still connecting.
    launch = ([str(STORE_WAIT_ALONE), "--nproc-per-node", "2"] if how == "script" else
              ["--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(STORE_WAIT_ALONE)])
    r = distcheck("run", "--stall-timeout", "20", *launch)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    s = _only(r.report)
    assert not s["ok"] and s["observed"] == ["crash"]
    [crash] = [f for f in s["findings"] if f["severity"] == "error"]
    assert crash["kind"] == "crash" and crash["odd_ranks"] == [0] and "wait timeout" in crash["summary"]
    line = next(i for i, text in enumerate(STORE_WAIT_ALONE.read_text().splitlines(), 1) if "# WAIT" in text)
    assert f"store_wait_alone.py:{line}" in crash["callsite"]
    assert [x["state"] for x in s["ranks"]] == ["crashed", "finished"]
