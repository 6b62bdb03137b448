"""Issues 13 and 22: partial passes accounted for, torchmetrics results checked against a single-process replay.

Pure tests of the rules on hand-made records, then real gloo ranks through the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import findings_less_torch_notes
from distcheck.diagnose.rules import observed_kinds
from distcheck.diagnose.duplicates import find_duplicates, find_partial_coverage
from distcheck.diagnose.metrics import find_metric_results
from distcheck.files.metric_records import MAX_CHECKED, chains, joint_computes, spread

pytest_plugins = ("pytester",)

SCRIPTS = Path(__file__).parent / "scripts"
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


def _compute(value, *, seq=0, after=3, group_rank=0, rank=None, t=100.0, line=41, epoch=0, updates=2, ranks=(0, 1)):
    return {"epoch": epoch, "updates": updates, "callsite": f"/x/model.py:{line}:on_validation_epoch_end",
            "value": value, "sync": {"ranks": list(ranks), "seq": seq, "after": after, "group_rank": group_rank,
                                     "rank": group_rank if rank is None else rank, "t0": t, "t1": t + 0.01}}


def _metric(key, computes, cls="MulticlassConfusionMatrix", sync=True):
    return {"id": key, "class": cls, "qualname": cls, "sync_on_compute": sync, "note": None, "computes": computes}


def _two_ranks(v0, v1, sync=True, **kw):
    return {r: {"metrics": [_metric("m0", [_compute(v, group_rank=r, **kw)], sync=sync)]}
            for r, v in enumerate((v0, v1))}


def _reference(check, chain="0:m0,1:m0"):
    return {"chains": {chain: {"checks": [{"joint": 0, **check}]}}}


def test_agreement_is_one_info_line_with_samples_and_class_counts():
    results = _two_ranks([[2, 0], [1, 3]], [[2, 0], [1, 3]])
    reference = _reference({"reference": [[2, 0], [1, 3]], "samples": 6, "class_counts": [2, 4],
                            "bad_states": []})
    [f] = find_metric_results(results, reference=reference)
    assert f.severity == "info" and f.data["agrees"] and f.data["class_counts"] == [2, 4]
    assert f.summary.startswith("MulticlassConfusionMatrix at model.py:41 matches a single-process computation "
                                "over the 6 samples the 2 ranks saw")


def test_a_wrong_reduction_is_an_error_naming_state_reduce_values_line_and_the_fix():
    bad = [{"state": "n", "reduce": "max", "synced": 12, "single_process": 30, "right": "sum", "integer": True}]
    results = {r: {"metrics": [_metric("m0", [_compute(12, group_rank=r, ranks=range(4))], cls="SampleCount")]}
               for r in range(4)}
    reference = _reference({"reference": 30, "samples": 30, "class_counts": None,
                            "bad_states": bad}, chain="0:m0,1:m0,2:m0,3:m0")
    [f] = find_metric_results(results, reference=reference)
    assert (f.kind, f.severity, f.data["state"], f.data["dist_reduce_fx"]) == ("numeric", "error", "n", "max")
    assert (f.data["actual"], f.data["reference"]) == (12, 30)
    assert f.summary.startswith("SampleCount at model.py:41: the synced compute() gave 12, a single process over "
                                "the same 30 samples from the 4 ranks gives 30.")
    assert "state 'n' uses dist_reduce_fx='max'" in f.summary and '`n` is a count: reduce it with "sum"' in f.summary


def test_computes_pair_by_their_sync_not_by_creation_order():
    # Rank 0 made a metric first that never synced (a pool task without collectives): its second one
    # synced with rank 1's first one.
    results = {0: {"metrics": [_metric("m0", [], cls="CatMetric"), _metric("m1", [_compute(3.0, group_rank=0)],
                                                                           cls="SumMetric")]},
               1: {"metrics": [_metric("m0", [_compute(3.0, group_rank=1)], cls="SumMetric")]}}
    [chain] = chains(joint_computes({r: res["metrics"] for r, res in results.items()}))
    assert chain["members"] == [[0, "m1"], [1, "m0"]]
    reference = _reference({"reference": 3.0, "samples": 2, "class_counts": None,
                            "bad_states": []}, chain="0:m1,1:m0")
    [f] = find_metric_results(results, reference=reference)
    assert f.severity == "info" and f.data["metric"] == "SumMetric"


def test_a_worker_back_under_another_rank_is_ordered_by_its_rank_then():
    # The process whose files say rank 0 was rank 1 of the re-initialized group, and the other way round.
    results = {0: {"metrics": [_metric("m0", [_compute([2.0, 1.0], group_rank=1)], cls="CatMetric")]},
               1: {"metrics": [_metric("m0", [_compute([2.0, 1.0], group_rank=0)], cls="CatMetric")]}}
    [joint] = joint_computes({r: res["metrics"] for r, res in results.items()})
    assert joint["members"] == [[1, "m0", 0], [0, "m0", 0]] and joint["ranks"] == [0, 1]


def test_the_same_point_of_two_process_groups_one_after_the_other_is_two_joints():
    # A pool re-initializes per test: seq restarts, the two tests' computes do not overlap in time.
    recorded = {r: [_metric("m0", [_compute(1.0, group_rank=r, t=100.0)]),
                    _metric("m1", [_compute(2.0, group_rank=1 - r, t=100.05)])] for r in range(2)}
    joints = joint_computes(recorded)
    assert [j["members"] for j in joints] == [[[0, "m0", 0], [1, "m0", 0]], [[1, "m1", 0], [0, "m1", 0]]]


def test_a_synced_compute_whose_partner_left_no_record_is_a_warning():
    results = {0: {"metrics": [_metric("m0", [_compute(3.0, group_rank=0)])]}, 1: {"metrics": []}}
    [f] = find_metric_results(results)
    assert f.severity == "warning" and "whose record of that compute() is missing" in f.summary
    assert "rank 1" in f.summary
    assert find_metric_results(results, finished=frozenset({0, 1})) == [f]


def test_a_partner_that_crashed_in_that_compute_leaves_no_warning_its_crash_is_the_finding():
    results = {0: {"metrics": [_metric("m0", [_compute(3.0, group_rank=0)])]}, 1: {"metrics": []}}
    assert find_metric_results(results, finished=frozenset({0})) == []


def test_sync_on_compute_false_with_different_values_is_a_warning_and_no_wrong_result():
    results = _two_ranks(1.0, 2.0, sync=False, after=0)
    [f] = find_metric_results(results)
    assert (f.severity, f.data["cross_rank"], f.data["values"]) == ("warning", True, {"0": 1.0, "1": 2.0})
    assert "sync_on_compute=False" in f.summary
    assert observed_kinds([f]) == ("pass",)


def test_a_synced_compute_with_different_values_is_an_error_and_crossed_metrics_are_named():
    [x] = find_metric_results(_two_ranks(2.0, 3.0))
    assert x.severity == "error" and x.data["values"] == {"0": 2.0, "1": 3.0}
    crossed = {0: {"metrics": [_metric("m0", [_compute(1.0, group_rank=0)], cls="BinaryConfusionMatrix")]},
               1: {"metrics": [_metric("m0", [_compute(1.0, group_rank=1)], cls="MulticlassConfusionMatrix")]}}
    [c] = find_metric_results(crossed)
    assert c.severity == "error" and c.data["crossed"] == {"BinaryConfusionMatrix": [0],
                                                           "MulticlassConfusionMatrix": [1]}


def test_a_check_that_could_not_run_is_a_warning_with_its_cause():
    results = _two_ranks(2.0, 2.0)
    reference = {"chains": {"0:m0,1:m0": {"skipped": "could not copy it for the replay "
                                                     "(PicklingError: x)"}}}
    [f] = find_metric_results(results, reference=reference)
    assert f.severity == "warning" and "could not be checked against a single process: could not copy" in f.summary
    reference = _reference({"unexplained": {"rank": 1, "state": "sum_value", "updates": 0}})
    [u] = find_metric_results(results, reference=reference)
    assert u.severity == "warning" and "does not give the state 'sum_value'" in u.summary
    assert observed_kinds([f, u]) == ("pass",)


def test_many_computes_pick_the_first_the_last_and_a_spread_between():
    assert spread(5) == set(range(5))
    picked = spread(1000)
    assert {0, 999} <= picked and len(picked) == MAX_CHECKED and max(b - a for a, b in
                                                                     zip(sorted(picked), sorted(picked)[1:])) < 60


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
    return [f for f in findings_less_torch_notes(s) if (kind is None or f["kind"] == kind)
            and (severity is None or f["severity"] == severity)]


@pytest.mark.e2e
@pytest.mark.ecosystem
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
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_a_count_reduced_with_max_is_numeric_and_sync_on_compute_false_a_warning_without_a_wrong_result(distcheck):
    # One launch, both metrics: the wrong reduction is the run's one error, the unsynced accuracy only a warning.
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", "--", "--wrong-reduce",
                  "--no-sync", timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [f] = _findings(r, severity="error")   # the unsynced accuracy gives no wrong result
    assert (f["kind"], f["data"]["metric"], f["data"]["state"], f["data"]["dist_reduce_fx"]) == \
        ("numeric", "CountedMean", "count", "max")
    assert f["data"]["reference"] == pytest.approx(f["data"]["actual"] / 2)   # 2 ranks: max count is half the sum
    assert "metric_sync.py:51" in f["summary"] and "state 'count' uses dist_reduce_fx='max'" in f["summary"]
    [w] = _findings(r, "numeric", "warning")
    assert w["data"]["metric"] == "MulticlassAccuracy"
    assert w["data"]["cross_rank"] and w["data"]["sync_on_compute"] is False
    assert len(set(map(str, w["data"]["values"].values()))) == 2


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_past_the_memory_cap_the_check_is_a_warning_naming_the_cap(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_sync.py"), "--nproc-per-node", "2", "--metric-memory-mb", "0.00001",
                  "--", "--wrong-reduce", timeout=E2E_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:]
    [note] = _findings(r, "numeric", "warning")
    assert "cap" in note["data"]["skipped"] and "could not be checked against a single process" in note["summary"]


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_unsharded_lightning_eval_cut_by_limit_val_batches_is_duplicates(distcheck):
    r = distcheck("run", str(SCRIPTS / "lightning_unsharded_val.py"), "--nproc-per-node", "4", timeout=E2E_TIMEOUT)
    assert r.returncode == 1
    [d] = _findings(r, "duplicates")
    assert "every rank evaluated the same 6 samples" in d["summary"] and d["data"]["missing"] == []
    [c] = _findings(r, "coverage")
    assert c["data"]["limit"] == {"setting": "limit_val_batches", "value": 2} and c["data"]["covered"] == 6


# -- issue 22: every script shape and launch mode, on real gloo ranks --------------------------------


WRONG_REDUCE = SCRIPTS / "wrong_reduce.py"
WRONG_REDUCE_LINE = "wrong_reduce.py:19"   # value = m.compute()


def _wrong_count(report: dict, metric: str, actual: int, reference: int) -> dict:
    """The one numeric error of a launch: ``metric``'s state n reduced with max, ``actual`` vs ``reference``."""
    errors = [f for s in report["scenarios"] for f in s["findings"] if f["kind"] == "numeric"
              and f["severity"] == "error"]
    assert len(errors) == 1, [f["summary"] for f in errors]
    [f] = errors
    assert (f["data"]["metric"], f["data"]["state"], f["data"]["dist_reduce_fx"]) == (metric, "n", "max")
    assert (f["data"]["actual"], f["data"]["reference"]) == (actual, reference)
    assert '`n` is a count: reduce it with "sum"' in f["summary"]
    return f


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_a_script_without_main_guard_gets_its_wrong_reduction_named_12_vs_30(distcheck):
    r = distcheck("run", str(WRONG_REDUCE), "--nproc-per-node", "4", timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    f = _wrong_count(r.report, "SampleCount", 12, 30)
    assert WRONG_REDUCE_LINE in f["summary"] and f["callsite"].endswith(":19:<module>")
    assert "RANK expected" not in r.stdout   # the script's top level ran once per rank, never in the replay


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_the_same_script_under_torchrun(distcheck):
    r = distcheck("run", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                  str(WRONG_REDUCE), timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert WRONG_REDUCE_LINE in _wrong_count(r.report, "SampleCount", 12, 30)["summary"]


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_the_same_script_as_a_module(distcheck):
    r = distcheck("run", "-m", "wrong_reduce", "--nproc-per-node", "2", timeout=E2E_TIMEOUT, cwd=SCRIPTS)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    _wrong_count(r.report, "SampleCount", 6, 9)


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(2 * E2E_TIMEOUT + 30)
def test_the_same_script_on_two_local_nodes_is_judged_with_both_nodes_inputs(tmp_path):
    from conftest import finish_process, free_port

    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distcheck", "run", str(WRONG_REDUCE), "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"m{port}",
         "--run-dir", str(tmp_path / f"node{n}"), "--json", str(tmp_path / f"node{n}.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
        for n in range(2)]
    # each node's own marker: the other node may still be finishing (or not yet reaped) meanwhile
    done = [finish_process(p, str(tmp_path / f"node{n}"), 2 * E2E_TIMEOUT) for n, p in enumerate(procs)]
    assert [d.returncode for d in done] == [1, 1], [d.stdout[-2000:] for d in done]
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["run"]["world_size"] == 4
    _wrong_count(report, "SampleCount", 12, 30)   # ranks 2 and 3's inputs came from node 1


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_a_class_nested_in_a_function_under_mp_spawn(distcheck):
    r = distcheck("run", "--", sys.executable, str(SCRIPTS / "metric_spawn.py"), timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert "metric_spawn.py:34" in _wrong_count(r.report, "LocalCount", 4, 6)["summary"]


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(2 * E2E_TIMEOUT + 30)
def test_a_lightning_module_as_a_script_and_under_lightnings_launcher(distcheck):
    script = SCRIPTS / "metric_lightning.py"
    for args in ([str(script), "--nproc-per-node", "2"], ["--", sys.executable, str(script)]):
        r = distcheck("run", *args, timeout=E2E_TIMEOUT)
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
        assert "metric_lightning.py:36" in _wrong_count(r.report, "SeenCount", 8, 16)["summary"]


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_a_class_from_a_module_nothing_can_import(distcheck):
    r = distcheck("run", str(SCRIPTS / "metric_hidden.py"), "--nproc-per-node", "2", timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    _wrong_count(r.report, "HiddenCount", 6, 9)


TM_DDP = SCRIPTS / "tm_ddp"


SUITE_TIMEOUT = 480   # 12 tests, each re-initializing the pool's process group: ~80 s quiet, 4 min and more at load 12


def _tm_ddp_suite(distcheck, *pytest_args: str, env: dict | None = None):
    return distcheck("run", "--timeout", str(SUITE_TIMEOUT), "--", sys.executable, "-m", "pytest", "-c",
                     str(TM_DDP / "pytest.ini"), str(TM_DDP), "-q", *pytest_args, timeout=SUITE_TIMEOUT + 60, env=env)


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(SUITE_TIMEOUT + 90)
def test_a_torchmetrics_style_ddp_suite_passes_with_its_metrics_checked(distcheck):
    r = _tm_ddp_suite(distcheck)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    numeric = [f for s in r.report["scenarios"] for f in s["findings"] if f["kind"] == "numeric"]
    assert [f["summary"] for f in numeric if f["severity"] == "error"] == []
    agree = {f["data"]["metric"] for f in numeric if f["severity"] == "info"}
    # arithmetic (SumMetric children), Running's restored window, collections, wrappers' inner metrics, a local class
    assert {"SumMetric", "DummyCount", "CatMetric", "MetricCollection", "MulticlassAccuracy", "MeanSquaredError",
            "MeanAbsoluteError", "LocalTotal"} <= agree, agree
    [unsynced] = [f for f in numeric if f["severity"] == "warning"]
    assert unsynced["data"]["sync_on_compute"] is False and set(map(str, unsynced["data"]["values"].values())) == \
        {"1.0", "2.0"}


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(SUITE_TIMEOUT + 90)
def test_a_wrong_reduction_planted_in_the_suite_is_still_an_error(distcheck):
    # The tests that use the planted metric (one of them after a healthy task in the same pool), not all 12.
    r = _tm_ddp_suite(distcheck, "-k", "count or uneven", env={"PLANT_WRONG_REDUCE": "1"})
    assert r.returncode == 1, r.stdout[-4000:]
    assert "2 passed" in r.stdout, r.stdout[-2000:]   # the suite's own tests still pass: only distcheck sees it
    errors = [f for s in r.report["scenarios"] for f in s["findings"] if f["severity"] == "error"]
    assert errors and all(f["kind"] == "numeric" and f["data"]["metric"] == "DummyCount" and f["data"]["state"] == "n"
                          and (f["data"]["actual"], f["data"]["reference"]) == (6, 9) for f in errors), errors


PLUGIN_MODULE = """
import pytest
import torch
from torchmetrics import Metric


class SampleCount(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max")

    def update(self, x):
        self.n += x.numel()

    def compute(self):
        return self.n


@pytest.mark.distributed(nproc=2)
def test_counts(dist_ctx):
    m = SampleCount()
    for _ in range(3):
        m.update(torch.ones(dist_ctx.rank + 1))
    m.compute()
"""


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_the_pytest_plugin_fails_a_test_whose_metric_reduction_is_wrong(pytester):
    path = pytester.makepyfile(test_metric=PLUGIN_MODULE)
    run_dir = pytester.path / "runs"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--distcheck-run-dir", str(run_dir), str(path),
                                           timeout=E2E_TIMEOUT)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "SampleCount" in text and "dist_reduce_fx='max'" in text and "gives 9" in text, text[-3000:]


@pytest.mark.e2e
@pytest.mark.ecosystem
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_many_computes_check_the_first_the_last_and_a_spread_between(distcheck):
    # One launch: the healthy metric and, beside it, the same metric with its count reduced with max.
    r = distcheck("run", str(SCRIPTS / "metric_many_computes.py"), "--nproc-per-node", "2", "--", "--wrong-reduce",
                  timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert _findings(r, severity="warning") == []
    [agree] = _findings(r, "numeric", "info")
    assert (agree["data"]["computes_checked"], agree["data"]["computes"]) == (20, 60)
    assert agree["data"]["samples"] == 30   # the last compute: 10 updates of 1 + 2 samples since its reset
    [wrong] = _findings(r, severity="error")
    # every checked compute but the first (all zeros) is wrong; the count n names the fix
    assert (wrong["data"]["computes_wrong"], wrong["data"]["computes_checked"], wrong["data"]["state"]) == (19, 20, "n")
