"""distcheck analyze on Flight Recorder dumps taken *after* the hung collective
failed — the dumps a user usually has (a ``finally:`` or an exception handler).

gloo retires an entry whether its call succeeded or failed, so a barrier that
timed out reads ``retired: True`` exactly like one that returned. The real
jobs (tests/fr_fail_job.py, torch's own launcher) leave:

* ``timeout``: 2 ranks; rank 0's barrier times out, rank 1 never called it;
* ``peer-exit``: 3 ranks; rank 1 leaves without calling the barrier that
  ranks 0 and 2 wait in, theirs fail with "Connection closed by peer".

Each must be a hang naming those ranks, exit 1, never a pass, never "distcheck
lost records". The NCCL and hook-recorded shapes no CPU machine writes are
hand-built from the fields PyTorch's recorder documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, finish_process
from distcheck.evidence.postmortem import analyze_paths
from distcheck.errors import ExitCode
from distcheck.files.flight_recorder import EntryEnd, entry_end
from distcheck.report.json_schema import REPORT
from distcheck.torch_features import features

JOB = REPO / "tests" / "fr_fail_job.py"
JOB_TIMEOUT_S = 180
WORLDS = {"timeout": 2, "peer-exit": 3}


def _launch(mode: str, out: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLDS[mode]),
            str(JOB), "--mode", mode, "--out", str(out)]
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, cwd=REPO / "tests")


@pytest.fixture(scope="module")
def failed_dumps(tmp_path_factory) -> dict[str, Path]:
    """Both jobs, started together so their waits overlap: mode → their dump folder."""
    if not features().flight_recorder_gloo:
        pytest.skip(features().missing_note("flight_recorder_gloo") + ": no gloo dumps to analyze")
    base = tmp_path_factory.mktemp("failed_dumps")
    procs = {mode: _launch(mode, base / mode) for mode in WORLDS}
    done = {}
    try:
        for mode, proc in procs.items():
            done[mode] = finish_process(proc, str(base / mode), JOB_TIMEOUT_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for mode, proc in done.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "barrier raised" in proc.stdout, proc.stdout   # the barrier really failed, it did not return
    return {mode: base / mode for mode in WORLDS}


def _analyze(folder: Path, tmp_path: Path, world: int) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{folder.name}.json"
    proc = finish_process(subprocess.Popen(
        [sys.executable, "-m", "distcheck", "analyze", str(folder), "--world-size", str(world), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO),
        "distcheck analyze", 60)
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT)
    return proc, report


def _only_hang(report: dict) -> dict:
    (scenario,) = report["scenarios"]
    assert not any("lost records" in f["summary"] for f in scenario["findings"])
    (hang,) = [f for f in scenario["findings"] if f["kind"] == "hang"]
    return hang


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_dumps_after_a_barrier_timeout_are_a_hang(failed_dumps, tmp_path, form):
    proc, report = _analyze(failed_dumps["timeout"] / form, tmp_path, 2)
    assert proc.returncode == ExitCode.FINDINGS, proc.stdout + proc.stderr
    assert report["verdict"] == "fail" and "PASS" not in proc.stdout and "lost records" not in proc.stdout
    hang = _only_hang(report)
    assert (hang["op"], hang["seq"], hang["waiting_ranks"], hang["absent_ranks"]) == ("barrier", 3, [0], [1])
    if form == "pickle":
        assert hang["callsite"].startswith(str(JOB)) and hang["callsite"].endswith(":main")
    (scenario,) = report["scenarios"]
    assert "rank 0: barrier (collective_seq_id 3) on group 0 was retired while rank 1 never entered it" in \
        " ".join(scenario["description"].split())
    states = {r["rank"]: r["state"] for r in scenario["ranks"]}
    assert states[0] == "stuck" and states[1] != "stuck"


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_dumps_after_a_peer_exit_name_the_rank_that_left(failed_dumps, tmp_path, form):
    proc, report = _analyze(failed_dumps["peer-exit"] / form, tmp_path, 3)
    assert proc.returncode == ExitCode.FINDINGS, proc.stdout + proc.stderr
    assert "PASS" not in proc.stdout and "lost records" not in proc.stdout
    hang = _only_hang(report)
    assert (hang["op"], hang["seq"]) == ("barrier", 3)
    assert hang["waiting_ranks"] == [0, 2] and hang["absent_ranks"] == [1] and hang["odd_ranks"] == [1]


@pytest.mark.e2e
def test_the_failed_barrier_really_reads_retired(failed_dumps):
    """What makes this case: gloo's own entry for the failed call says retired, and nothing else."""
    entries = json.loads((failed_dumps["timeout"] / "json" / "fr_0.json").read_text())["entries"]
    barrier = next(e for e in entries if e["profiling_name"] == "gloo:barrier")
    assert barrier["retired"] is True and barrier["state"] == "scheduled"
    assert entry_end(barrier) == EntryEnd.ENDED


# -- hand-built dumps ---------------------------------------------------------------


def _entry(i: int, seq: int, name: str, *, state: str = "scheduled", retired: bool = True) -> dict:
    return {"record_id": i, "process_group": ["0", "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 0,
            "is_p2p": False, "profiling_name": name, "input_sizes": [[4]], "input_dtypes": ["Float"],
            "state": state, "retired": retired, "time_created_ns": 10**18 + i,
            "time_discovered_completed_ns": 10**18 + i + 5 if state == "completed" else None}


def _write(tmp_path: Path, per_rank: dict[int, list[dict]]) -> Path:
    for rank, entries in per_rank.items():
        (tmp_path / f"fr_{rank}.json").write_text(json.dumps({"version": "2.10", "pg_config": {}, "entries": entries}))
    return tmp_path


def test_gloo_dumps_of_a_healthy_job_pass(tmp_path):
    """Every member entered every retired call: completed, a pass with no note of lost records."""
    per_rank = {r: [_entry(i, i + 1, "gloo:all_reduce") for i in range(3)] for r in range(3)}
    report = analyze_paths([_write(tmp_path, per_rank)], world_size=3).report
    (scenario,) = report.scenarios
    assert scenario.ok and scenario.observed == ("pass",) and not scenario.findings


def test_a_rank_with_an_empty_dump_does_not_fail_its_peers_calls(tmp_path):
    """A rank whose dump holds no entry (recorder off there) tells nothing: the others' calls still count."""
    per_rank = {0: [_entry(0, 1, "gloo:all_reduce")], 1: [_entry(0, 1, "gloo:all_reduce")], 2: []}
    (scenario,) = analyze_paths([_write(tmp_path, per_rank)], world_size=3).report.scenarios
    assert not any(f.kind == "hang" for f in scenario.findings)


def test_nccl_retired_without_its_end_event_failed(tmp_path):
    """NCCL's watchdog retires a work that failed, timed out or was aborted; only ``state: completed``
    (its end event fired) is a finished call — even when every rank entered it."""
    per_rank = {r: [_entry(0, 1, "nccl:all_reduce", state="completed"),
                    _entry(1, 2, "nccl:all_reduce", state="started")] for r in range(2)}
    assert entry_end(per_rank[0][1]) == EntryEnd.FAILED
    assert entry_end({**per_rank[0][1], "retired": False}) == EntryEnd.PENDING
    (scenario,) = analyze_paths([_write(tmp_path, per_rank)], world_size=2).report.scenarios
    (hang,) = [f for f in scenario.findings if f.kind == "hang"]
    assert (hang.seq, hang.waiting_ranks, hang.absent_ranks) == (2, (0, 1), ())
    assert "retired without its end event" in scenario.description


def test_nccl_pending_call_before_a_completed_one_finished(tmp_path):
    """One stream runs a group's calls in order: a call not yet retired before a completed one finished."""
    entries = [_entry(0, 1, "nccl:all_reduce", state="started", retired=False),
               _entry(1, 2, "nccl:all_reduce", state="completed")]
    (scenario,) = analyze_paths([_write(tmp_path, {0: entries, 1: entries})], world_size=2).report.scenarios
    assert scenario.ok and not scenario.findings


def test_a_dump_taken_before_a_call_its_peers_completed_is_no_lost_record(tmp_path):
    """NCCL completes a call only once every member entered it: a peer's dump without it was taken
    earlier. It is compared as far as it goes — never "distcheck lost records", never a pass by default."""
    done = [_entry(i, i + 1, "nccl:all_reduce", state="completed") for i in range(3)]
    per_rank = {0: done, 1: done[:2], 2: done}
    (scenario,) = analyze_paths([_write(tmp_path, per_rank)], world_size=3).report.scenarios
    assert not any(f.kind == "coverage" or "lost records" in f.summary for f in scenario.findings)
    assert scenario.ok and "rank 1: its dump was taken before it entered a call its peers finished" in \
        " ".join(scenario.description.split())
    pending = {**per_rank, 0: [*done, _entry(3, 4, "nccl:all_reduce", state="started", retired=False)],
               2: [*done, _entry(3, 4, "nccl:all_reduce", state="started", retired=False)]}
    (scenario,) = analyze_paths([_write(tmp_path, pending)], world_size=3).report.scenarios
    (hang,) = [f for f in scenario.findings if f.kind == "hang"]
    assert (hang.seq, hang.waiting_ranks) == (4, (0, 2)) and 1 not in hang.absent_ranks
    assert not any("lost records" in f.summary for f in scenario.findings)


def test_nccl2_hook_entries_need_their_end_event_and_c10d_ones_their_peers():
    """torch's newer NCCL backend records through a hook that retires a call when it is issued: only the
    end event (state: completed) says it finished. A ``c10d:`` hook entry may have no device event at all."""
    issued = _entry(0, 1, "nccl2:all_reduce", state="scheduled")
    assert entry_end(issued) == EntryEnd.FAILED
    assert entry_end({**issued, "state": "completed"}) == EntryEnd.COMPLETED
    assert entry_end(_entry(0, 1, "c10d:allreduce")) == EntryEnd.ENDED
