"""Issue 13: partial passes accounted for, torchmetrics results checked against a single-process replay.

Pure tests of the rules on hand-made records, then real gloo ranks through the real CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distcheck.diagnose.duplicates import find_duplicates, find_partial_coverage
from distcheck.diagnose.metrics import find_metric_results

SCRIPTS = Path(__file__).parent / "scripts"
SEED = Path(__file__).parent.parent / "scenarios" / "lightning_confmat_limit_val.py"
E2E_TIMEOUT = 180


def _pass(ids, complete=False, batches=2, stage="validation", limits=None):
    return {"dataset": "TensorDataset (loader 0, pass 0)", "dataset_size": 100, "ids": ids, "complete": complete,
            "batches": batches, "batch_size": 3, "stage": stage, "limits": limits or {"limit_val_batches": 2}}


# -- pure rules -------------------------------------------------------------------------------


def test_a_cut_pass_overlapping_on_every_rank_is_duplicates_without_never_seen():
    results = {r: {"samples": [_pass(list(range(6)))]} for r in range(4)}
    [d] = find_duplicates(results, 4)
    assert "every rank evaluated the same 6 samples" in d.summary
    assert d.data["missing"] == [] and d.data["partial_pass"] and "never seen" not in d.summary


def test_a_cut_sharded_pass_is_coverage_naming_the_lightning_setting():
    results = {r: {"samples": [_pass(list(range(r * 6, r * 6 + 6)))]} for r in range(4)}
    assert find_duplicates(results, 4) == []
    [c] = find_partial_coverage(results)
    assert c.kind == "coverage" and c.severity == "info"
    assert c.summary.startswith("validation covered 24 of 100 samples (4 ranks × 2 batches × 3; limit_val_batches=2)")
    assert (c.data["covered"], c.data["dataset_size"], c.data["limit"]) == (24, 100, {"setting": "limit_val_batches",
                                                                                        "value": 2})


def test_a_pass_that_ran_to_the_end_has_no_coverage_line_and_old_records_count_as_whole():
    whole = {r: {"samples": [{"dataset": "d", "dataset_size": 8, "ids": list(range(r * 4, r * 4 + 4))}]}
             for r in range(2)}
    assert find_partial_coverage(whole) == [] and find_duplicates(whole, 2) == []


def _metric(values, reduce_ok=True, sync=True):
    return {"id": "m0", "class": "MulticlassConfusionMatrix", "sync_on_compute": sync, "note": None,
            "computes": [{"epoch": 0, "updates": 2, "callsite": "/x/model.py:41:on_validation_epoch_end",
                          "value": values}]}


def test_agreement_is_one_info_line_with_samples_and_class_counts():
    ref = {"metrics": {"m0": {"computes": [{"reference": [[2, 0], [1, 3]], "samples": 6, "class_counts": [2, 4],
                                            "bad_states": []}]}}}
    results = {0: {"metrics": [_metric([[2, 0], [1, 3]])], "metric_reference": ref},
               1: {"metrics": [_metric([[2, 0], [1, 3]])]}}
    [f] = find_metric_results(results)
    assert f.severity == "info" and f.data["agrees"] and f.data["class_counts"] == [2, 4]
    assert f.summary.startswith("MulticlassConfusionMatrix at model.py:41 matches a single-process computation "
                                "over the 6 samples the 2 ranks saw")


def test_a_wrong_reduction_is_numeric_naming_the_state_and_different_values_are_cross_rank():
    bad = [{"state": "count", "reduce": "max", "synced": 12, "single_process": 24}]
    ref = {"metrics": {"m0": {"computes": [{"reference": 1.0, "samples": 24, "class_counts": None,
                                            "bad_states": bad}]}}}
    results = {r: {"metrics": [_metric(2.0)]} for r in range(2)}
    results[0]["metric_reference"] = ref
    [f] = find_metric_results(results)
    assert (f.kind, f.severity, f.data["state"], f.data["dist_reduce_fx"]) == ("numeric", "error", "count", "max")
    assert "gave 2, a single process" in f.summary or "gave 2.0" in f.summary
    results[1]["metrics"] = [_metric(3.0, sync=False)]
    [x] = find_metric_results(results)
    assert x.data["cross_rank"] and x.data["values"] == {"0": 2.0, "1": 3.0}


# -- recording leaves the metric alone --------------------------------------------------------


RECORDING_CHANGES_NOTHING = """
import sys, tempfile, torch
from pathlib import Path
from distcheck.rank import metrics
from torchmetrics.classification import MulticlassConfusionMatrix
g = torch.Generator().manual_seed(0)
data = [(torch.randint(0, 5, (64,), generator=g), torch.randint(0, 5, (64,), generator=g)) for _ in range(50)]
plain = MulticlassConfusionMatrix(num_classes=5)
for p, t in data: plain.update(p, t)
metrics.install(Path(tempfile.mkdtemp()))
import importlib, torchmetrics.metric, torchmetrics.collections
metrics._patch_metric(torchmetrics.metric)
recorded = MulticlassConfusionMatrix(num_classes=5)
for p, t in data: recorded(p, t)
for p, t in data: recorded.update(p, t)
assert metrics.RECORDER.entries, "nothing was recorded"
assert torch.equal(recorded.compute(), 2 * plain.compute()), "recording changed the result"
print("ok")
"""


def test_recording_does_not_change_the_metric_result():
    out = subprocess.run([sys.executable, "-c", RECORDING_CHANGES_NOTHING], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- real gloo ranks ------------------------------------------------------------------------------


def _findings(r, kind=None, severity=None):
    [s] = r.report["scenarios"]
    return [f for f in s["findings"] if (kind is None or f["kind"] == kind)
            and (severity is None or f["severity"] == severity)]


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_healthy_torchmetrics_script_agrees_with_its_replay(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", timeout=E2E_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert _findings(r, severity="error") == [] and _findings(r, severity="warning") == []
    agree = {f["data"]["metric"]: f["data"] for f in _findings(r, "numeric", "info")}
    assert set(agree) == {"MulticlassConfusionMatrix", "MetricCollection"}   # compute groups included
    assert agree["MulticlassConfusionMatrix"]["samples"] == 24 and sum(agree["MulticlassConfusionMatrix"]
                                                                       ["class_counts"]) == 24
    assert "matches a single-process computation over the 24 samples the 2 ranks saw" in r.stdout


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_a_count_state_reduced_with_max_is_numeric_naming_the_state(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", "--", "--wrong-reduce",
                  timeout=E2E_TIMEOUT)
    assert r.returncode == 1
    [f] = _findings(r, "numeric", "error")
    assert (f["data"]["metric"], f["data"]["state"], f["data"]["dist_reduce_fx"]) == ("CountedMean", "count", "max")
    assert f["data"]["reference"] == pytest.approx(f["data"]["actual"] / 2)   # 2 ranks: max count is half the sum
    assert "metric_sync.py:51" in f["summary"] and "state 'count' uses dist_reduce_fx='max'" in f["summary"]


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_sync_on_compute_false_gives_the_cross_rank_finding(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", "--", "--no-sync",
                  timeout=E2E_TIMEOUT)
    assert r.returncode == 1
    [f] = _findings(r, "numeric", "error")
    assert f["data"]["cross_rank"] and f["data"]["sync_on_compute"] is False
    assert len(set(f["data"]["values"].values())) == 2


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_past_the_memory_cap_the_check_is_skipped_with_a_note(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", "--metric-memory-mb", "0.00001",
                  "--", "--wrong-reduce", timeout=E2E_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:]
    [note] = _findings(r, "numeric", "info")
    assert "cap" in note["data"]["skipped"] and "not checked against a single process" in note["summary"]


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_unsharded_lightning_eval_cut_by_limit_val_batches_is_duplicates(distcheck):
    r = distcheck("run", str(SCRIPTS / "lightning_unsharded_val.py"), "--nproc-per-node", "4", timeout=E2E_TIMEOUT)
    assert r.returncode == 1
    [d] = _findings(r, "duplicates")
    assert "every rank evaluated the same 6 samples" in d["summary"] and d["data"]["missing"] == []
    [c] = _findings(r, "coverage")
    assert c["data"]["limit"] == {"setting": "limit_val_batches", "value": 2} and c["data"]["covered"] == 6


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_the_seed_scenario_has_coverage_agreement_and_class_counts_as_fields(distcheck):
    r = distcheck("run", str(SEED), "--nproc-per-node", "4", timeout=E2E_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    check_seed(r.report["scenarios"][0], 4)
    assert "validation covered 480 of 10,000 samples (4 ranks × 10 batches × 12; limit_val_batches=10)" in r.stdout


def check_seed(s: dict, world: int) -> None:
    """What the seed's report must say (also the catalogue's check)."""
    assert s["observed"] == ["pass"]
    [agree] = [f for f in s["findings"] if f["kind"] == "numeric"]
    assert agree["severity"] == "info" and agree["data"]["agrees"]
    assert agree["data"]["samples"] == 120 * world and sum(agree["data"]["class_counts"]) == 120 * world
    [val] = [f for f in s["findings"] if f["kind"] == "coverage" and f["data"]["stage"] == "validation"]
    assert (val["data"]["covered"], val["data"]["dataset_size"]) == (120 * world, 10_000)
    assert val["data"]["limit"] == {"setting": "limit_val_batches", "value": 10}
