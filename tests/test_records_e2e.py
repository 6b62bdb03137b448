"""Exact records (issue 24): every collective a rank issued is in its record, C++-issued ones included,
for scripts run as files, on a quiet node and beside CPU hogs (2x oversubscription of the cores).

A job that completed with every rank back from every call issued the same collectives on every rank:
each rank's count must be equal and include DDP's, FSDP2's, Join's and the P2P batch's calls, and no
finding may accuse the job. Faults are still named right under load: a C++-issued hang, a rank-0-only
``dcp.save``, and the OOM-skip mismatch explained from the survivors' in-flight C++-issued call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import LOADED_TIMEOUT_S as LOADED_TIMEOUT
from distcheck.torch_features import features

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "scripts" / "records"
HEALTHY = {                      # script: ranks
    "ddp_recipe.py": 4,
    "ddp_join.py": 3,
    "fsdp2_train.py": 2,
    "p2p_ring.py": 4,
    "lightning_fit.py": 2,
}


def _only(report: dict) -> dict:
    [s] = report["scenarios"]
    return s


def _assert_exact_and_clean(r, script: str) -> None:
    s = _only(r.report)
    problems = [f["summary"] for f in s["findings"] if f["severity"] in ("error", "warning")]
    assert r.returncode == 0 and s["observed"] == ["pass"] and not problems, (script, problems, r.stderr[-2000:])
    counts = {x["rank"]: x["collectives"] for x in s["ranks"]}
    assert len(set(counts.values())) == 1, (script, counts)
    assert all(x["state"] == "finished" for x in s["ranks"])


def _native_calls(r) -> int:
    """C++-issued calls in rank 0's record (DDP init and reducer, FSDP2, Join's shadow calls)."""
    from distcheck.files.trace_reader import parse_trace

    launch = Path(_only(r.report)["launch_dir"])
    return sum(e.native for e in parse_trace(0, (launch / "traces" / "rank0.trace").read_bytes()).events)


# The runs beside the hogs start together with test_ecosystem_e2e's, one concurrent group beside one set of hogs
# (conftest's ``runs_beside_hogs``): the node is busier than 2x oversubscribed while they run, and the hogs
# (and the suite) wait for one group, not for eleven launches.
FAULTS = {                       # name: (script, ranks, script arguments)
    "ddp_uneven": (Path(__file__).parent / "scripts" / "ddp_uneven.py", 2, ()),
    "dcp_save_rank0": (SCRIPTS / "dcp_save_rank0.py", 3, ("{tmp}/ckpt",)),
    "ddp_oom_skip": (SCRIPTS / "ddp_oom_skip.py", 3, ()),
}


def loaded_jobs() -> dict[str, list[str]]:
    """Every script of this module's loaded tests: name -> its ``distcheck run`` arguments."""
    jobs = {script: [str(SCRIPTS / script), "--nproc-per-node", str(ranks)] for script, ranks in HEALTHY.items()
            if not (script.startswith("fsdp2") and not features().fully_shard_cpu)}
    for name, (path, ranks, args) in FAULTS.items():
        if name != "ddp_oom_skip" or features().flight_recorder_gloo:
            jobs[name] = [str(path), "--nproc-per-node", str(ranks), "--stall-timeout", "5"] + (["--", *args] if args
                                                                                                else [])
    return jobs


@pytest.fixture(scope="module")
def loaded_runs(runs_beside_hogs) -> dict:
    """This module's loaded runs, finished; name -> the run."""
    return runs_beside_hogs[__name__]


@pytest.mark.timeout(LOADED_TIMEOUT + 60)
@pytest.mark.parametrize("script", sorted(HEALTHY))
def test_healthy_script_under_load_is_exact_and_clean(loaded_runs, script):
    if script.startswith("fsdp2") and not features().fully_shard_cpu:
        pytest.skip(features().missing_note("fully_shard_cpu"))
    r = loaded_runs[script]
    _assert_exact_and_clean(r, script)
    if script != "p2p_ring.py":
        assert _native_calls(r) > 0, "the C++-issued calls are in the record"
    if script == "ddp_recipe.py":   # every rank the same count, DDP's own calls included, exactly
        # DDP init (all_gather + 2 broadcasts), the bucket rebuild (2 broadcasts), 5 gradient all_reduces
        assert _native_calls(r) == 10
        assert {x["collectives"] for x in _only(r.report)["ranks"]} == {16}   # + 5 logging all_reduces + barrier


@pytest.mark.timeout(LOADED_TIMEOUT + 60)
def test_cpp_issued_hang_under_load(loaded_runs):
    uneven = FAULTS["ddp_uneven"][0]
    r = loaded_runs["ddp_uneven"]
    assert r.returncode == 1
    [hang] = [f for f in _only(r.report)["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1]
    issuer = "DDP gradient all_reduce" if features().flight_recorder_gloo else "DDP's reducer in backward()"
    assert hang["label"].startswith(issuer) and "certain: rank 1 finished" in hang["summary"]
    assert "BACKWARD" in uneven.read_text().splitlines()[int(hang["callsite"].split(":")[1]) - 1]


@pytest.mark.timeout(LOADED_TIMEOUT + 60)
def test_rank0_only_dcp_save_under_load_is_a_hang_on_the_save_line(loaded_runs):
    script = FAULTS["dcp_save_rank0"][0]
    r = loaded_runs["dcp_save_rank0"]
    assert r.returncode == 1
    [hang] = [f for f in _only(r.report)["findings"] if f["kind"] == "hang"]
    assert hang["waiting_ranks"] == [0] and hang["absent_ranks"] == [1, 2], hang["summary"]
    assert "# SAVE" in script.read_text().splitlines()[int(hang["callsite"].split(":")[1]) - 1]


@pytest.mark.timeout(LOADED_TIMEOUT + 60)
@pytest.mark.skipif(not features().flight_recorder_gloo, reason="only the Flight Recorder says the size of DDP's "
                    "bucket, and gloo has none before torch 2.8")
def test_oom_skip_under_load_is_a_shape_mismatch_against_ddps_bucket(loaded_runs):
    script = FAULTS["ddp_oom_skip"][0]
    r = loaded_runs["ddp_oom_skip"]
    assert r.returncode == 1
    [m] = [f for f in _only(r.report)["findings"] if f["kind"] == "mismatch"]
    assert m["odd_ranks"] == [1] and m["fields"] == ["shape"], m["summary"]
    assert "DDP gradient all_reduce, bucket of 577 elements" in m["summary"]
    odd = {d["rank"]: d for d in m["ranks"]}[1]
    assert "# LOGGING" in script.read_text().splitlines()[int(odd["callsite"].split(":")[1]) - 1]
