"""The scenario catalogue end to end: real gloo ranks through the real CLI.

One ``distcheck run`` per world size keeps the cost down (every launch pays for
importing torch on every rank); each scenario is then checked against what the
issue asks of it. Failures are collected per scenario so one run reports every
scenario that misbehaved, not only the first.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import pytest

from conftest import findings_less_torch_notes
from distcheck.diagnose.backend_error import SIZE_TEXTS
from distcheck.targets.discovery import builtin_scenarios
from distcheck.models import UNKNOWN_OP
from distcheck.scenario import TORCH_FEATURE, skip_reason
from distcheck.torch_features import features

pytestmark = pytest.mark.e2e

STALL = 5
BUSY_S = 8    # rank0_slow_then_barrier: rank 0 computes this long (> STALL) before its barrier
# Generous hard limits: the machine running the suite may be shared; normal runs take a fraction.
HARD_TIMEOUT_4 = 540
HARD_TIMEOUT_2 = 360
WIDE = {"COLUMNS": "250"}     # fewer wrapped lines in the terminal report

CATALOGUE = (
    "reduce_op_mismatch", "confmat_local_num_classes", "auroc_empty_rank", "metrics_computed_in_different_order",
    "uneven_shards_allreduce", "rank_raises_mid_loop", "mean_of_means", "weighted_mean",
    "sampler_padding_confmat", "unrepeated_sharding_confmat", "unsharded_eval_data", "straggler",
    "cpu_state_on_nccl", "iterable_eval_unsharded",
)

PASSES_AT_2 = ("collectives_sanity", "auroc_all_ranks_compute")   # with numeric checks, and no finding at all
Check = Callable[[dict, int], None]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn
    return register


def builtin_dir() -> Path:
    return Path(builtin_scenarios()[0].file).parent


def findings(s: dict, kind: str) -> list[dict]:
    return [f for f in s["findings"] if f["kind"] == kind]


def source_line(callsite: str) -> str:
    path, line = callsite.split(":")[:2]
    return Path(path).read_text().splitlines()[int(line) - 1]


def line_of(callsite: str) -> str:
    """'reduce_op_mismatch.py:24' — how a callsite appears in a summary."""
    path, line = callsite.split(":")[:2]
    return f"{Path(path).name}:{line}"


def odd(world: int) -> list[int]:
    """The catalogue puts the odd one out on the last rank; on 2 ranks that is a tie, with no odd side."""
    return [world - 1] if world > 2 else []


def _behaved(s: dict, world: int) -> None:
    """Nothing beyond ``ok``, which ``verify`` asserts for every scenario."""


def verify(run, world: int, names: tuple[str, ...], checked: tuple[str, ...] | None = None) -> None:
    """Each of ``names`` as expected, and as its check asks (``checked``: only these scenarios' checks, the
    others' expectation alone: a check written for 4 ranks asks for an odd one out that 2 ranks cannot have)."""
    failures = []
    for name in names:
        s = run.scenario(name)
        if _lacks_torch_feature(name):   # skipped, saying what this torch lacks (tests/test_torch_versions.py)
            assert s["skipped"] and "lacks" in s["skipped"], (name, s["skipped"])
            continue
        try:
            assert s["ok"], f"expected {s['expected']}, observed {s['observed']}"
            if checked is None or name in checked:
                CHECKS.get(name, _behaved)(s, world)   # scenarios added by others: their expectation only
            _findings_agree_on_where_each_rank_was(s)
        except AssertionError as exc:
            summaries = "\n".join(f"    {f['kind']}: {f['summary']}" for f in s["findings"])
            failures.append(f"{name} at {world} ranks: {exc}\n{summaries}")
    assert not failures, "\n\n".join(failures)


def _lacks_torch_feature(name: str) -> bool:
    spec = next(spec for spec in builtin_scenarios() if spec.name == name)
    return skip_reason(spec, "gloo", 4) is not None and any(r.startswith(TORCH_FEATURE) for r in spec.requires)


def _findings_agree_on_where_each_rank_was(s: dict) -> None:
    """No hang finding puts a rank somewhere its final state contradicts: a rank it says is waiting
    is stuck (in that very call), and a rank said to be absent is not stuck in that call."""
    ranks = {r["rank"]: r for r in s["ranks"]}
    if s["end_reason"] == "completed" and all(r["state"] == "finished" for r in s["ranks"]):
        # every rank came back from every call: a count or hang error could only come from lost records
        wrong = [f["summary"] for f in s["findings"] if f["kind"] in ("count", "hang") and f["severity"] == "error"]
        assert not wrong, wrong
    for f in s["findings"]:
        if f["kind"] != "hang":
            continue   # a straggler's waiting ranks waited once and went on: not where they ended
        calls = {r: (c["group"], c["seq"]) for c in f["data"].get("cycle", ()) for r in c["ranks"]}
        for r in f["waiting_ranks"]:
            assert ranks[r]["state"] in ("stuck", "crashed"), (f["kind"], r, ranks[r]["state"], f["summary"])
            last = ranks[r]["last_event"]
            if f["kind"] == "hang" and f["seq"] is not None and ranks[r]["state"] == "stuck":
                assert (last["group"], last["seq"]) == calls.get(r, (f["group"], f["seq"])), (r, last, f["summary"])
        for r in f["absent_ranks"]:
            last = ranks[r]["last_event"]
            # the same number with another op (2 ranks each in its own call #8: a clash) is not that call
            in_it = (last and (last["group"], last["seq"], last["op"]) == (f["group"], f["seq"], f["op"])
                     and last["t_exit"] is None)
            assert not (ranks[r]["state"] == "stuck" and in_it), (r, f["summary"])


# -- structural mismatches ---------------------------------------------------------


@check("reduce_op_mismatch")
def _reduce_op(s: dict, world: int) -> None:
    assert s["observed"] == ["mismatch"]
    [m] = findings(s, "mismatch")
    assert m["fields"] == ["reduce_op"]
    assert (m["op"], m["seq"], m["tie"]) == ("all_reduce", 1, world == 2)
    assert m["odd_ranks"] == odd(world)
    if world > 2:
        assert m["majority"]["reduce_op"] == "SUM"
    else:
        assert m["majority"] is None
    sites = {d["rank"]: d["callsite"] for d in m["ranks"]}
    assert sorted(sites) == list(range(world))
    assert "ReduceOp.MAX" in source_line(sites[world - 1])
    assert all("ReduceOp.SUM" in source_line(sites[r]) for r in range(world - 1))
    assert line_of(sites[0]) in m["summary"] and line_of(sites[world - 1]) in m["summary"]
    assert m["data"]["repeated_at"] == [2, 3]
    assert all(r["state"] == "finished" for r in s["ranks"])   # SUM vs MAX completes silently


@check("confmat_local_num_classes")
def _confmat_shape(s: dict, world: int) -> None:
    [m] = findings(s, "mismatch")
    assert (m["fields"], m["op"], m["seq"]) == (["shape"], "all_reduce", 1)
    assert m["odd_ranks"] == odd(world)
    assert m["data"]["values"]["shape"] == {"[3, 3]": list(range(world - 1)), "[4, 4]": [world - 1]}
    for crash in findings(s, "crash"):   # gloo usually aborts a rank here: a consequence, said so
        assert crash["data"]["caused_by"]["seq"] == 1 and "most likely a consequence" in crash["summary"]


@check("auroc_empty_rank")
def _auroc_dtype(s: dict, world: int) -> None:
    [m] = findings(s, "mismatch")
    assert m["fields"] == ["dtype"]
    # #6 is the target's data all_gather: barrier, shapes, preds, then barrier, shapes, target.
    assert (m["op"], m["seq"], m["label"]) == ("all_gather", 6, "BinaryAUROC.compute")
    assert m["data"]["values"]["dtype"] == {"int64": list(range(world - 1)), "float32": [world - 1]}
    assert m["odd_ranks"] == odd(world)
    assert all(d["label"] == "BinaryAUROC.compute" and d["callsite"] for d in m["ranks"])
    killed = [r for r in s["ranks"] if r["state"] == "crashed"]
    assert killed and all(r["signal"] == "SIGABRT" and r["collectives"] == 6 for r in killed), s["ranks"]
    [crash] = findings(s, "crash")
    assert crash["data"]["caused_by"] == {"kind": "mismatch", "group": m["group"], "seq": 6, "fields": ["dtype"]}
    assert [f["kind"] for f in findings_less_torch_notes(s)] == ["mismatch", "crash"]   # the cause first


# -- crossed metrics -------------------------------------------------------------------


@check("metrics_computed_in_different_order")
def _order(s: dict, world: int) -> None:
    assert s["observed"] == ["numeric", "order"]
    [o] = findings(s, "order")
    assert o["fields"] == ["label"] and o["seq"] == 1 and o["odd_ranks"] == odd(world)
    labels = {d["rank"]: d["label"] for d in o["ranks"]}
    assert labels == {r: "MulticlassConfusionMatrix.compute" if r == world - 1 else "BinaryConfusionMatrix.compute"
                      for r in range(world)}
    if world > 2:
        assert o["majority"]["label"] == "BinaryConfusionMatrix.compute"
    assert o["data"]["repeated_at"] == [2, 3, 4, 5, 6]
    assert {f["data"]["check"] for f in findings(s, "numeric")} == {"spam confusion matrix", "lang confusion matrix"}
    assert all(r["state"] == "finished" for r in s["ranks"])   # no backend error at all


# -- hangs and crashes -------------------------------------------------------------------


@check("uneven_shards_allreduce")
def _uneven(s: dict, world: int) -> None:
    [h] = findings(s, "hang")
    batches = math.ceil(math.ceil(21 / world) / 2)   # of every full shard
    assert (h["op"], h["seq"]) == ("all_reduce", batches)
    assert h["waiting_ranks"] == list(range(world - 1)) and h["absent_ranks"] == [world - 1]
    assert "finished, now idle" in h["summary"]
    assert h["detected_after_s"] <= STALL + 3


@check("rank_raises_mid_loop")
def _raises(s: dict, world: int) -> None:
    [c] = findings(s, "crash")
    assert c["data"]["root_rank"] == world - 1
    assert "ValueError: corrupt sample in batch 3" in c["summary"]
    assert "raise ValueError" in source_line(c["callsite"])
    states = {r["rank"]: r["state"] for r in s["ranks"]}
    assert states[world - 1] == "crashed"
    assert all(states[r] in ("stuck", "killed") for r in range(world - 1)), states


# -- wrong numbers ---------------------------------------------------------------------


@check("mean_of_means")
def _mean_of_means(s: dict, world: int) -> None:
    [n] = findings(s, "numeric")
    mean_of_means = (1.0 + 0.5 * (world - 1)) / world          # rank 0: 2/2 right, the others 3/6
    overall = (2 + 3 * (world - 1)) / (2 + 6 * (world - 1))
    assert n["data"]["actual"] == pytest.approx(mean_of_means)
    assert n["data"]["reference"] == pytest.approx(overall)
    assert n["odd_ranks"] == list(range(world))


@check("sampler_padding_confmat")
def _padding(s: dict, world: int) -> None:
    size = 10 if 10 % world else 11
    padded = math.ceil(size / world) * world
    [d] = findings(s, "duplicates")
    # shuffle=False: the sampler repeats ids 0, 1, ... at the end; id k lands on ranks k % w and (size + k) % w.
    assert d["data"]["duplicated"] == {str(k): sorted({k % world, (size + k) % world}) for k in range(padded - size)}
    assert d["data"]["missing"] == []
    assert f"DistributedSampler padded {size} samples to {padded} for {world} ranks" in d["summary"]
    [n] = findings(s, "numeric")
    diffs = [e["actual"] - e["reference"] for e in n["data"]["differing"]]
    assert diffs and all(x > 0 for x in diffs) and sum(diffs) == padded - size   # each repeat counted once more


@check("unsharded_eval_data")
def _unsharded(s: dict, world: int) -> None:
    [d] = findings(s, "duplicates")
    assert d["data"]["same_on_every_rank"]
    assert d["data"]["duplicated"] == {str(i): list(range(world)) for i in range(8)}
    assert d["data"]["missing"] == list(range(8, 8 * world))
    assert "every rank evaluated the same 8 samples" in d["summary"]
    [n] = findings(s, "numeric")
    assert f"the grand total {8 * world} is right" in n["summary"]   # rows wrong, total right


@check("iterable_eval_unsharded")
def _iterable_unsplit(s: dict, world: int) -> None:
    # No sampler: the rows every rank fed MulticlassAccuracy say that each evaluated the whole stream.
    [d] = findings(s, "duplicates")
    assert d["severity"] == "error" and d["data"]["fed"] and d["data"]["same_on_every_rank"]
    assert d["data"]["rows"] == {str(r): 60 for r in range(world)}
    assert f"counted {60 * world} rows for 60 samples" in d["summary"]


@check("lightning_confmat_limit_val")
def _seed_confmat(s: dict, world: int) -> None:
    # The sync is right (the replay agrees); the rows count only the 120 samples per rank the cut pass saw.
    assert s["observed"] == ["pass"]
    [agree] = findings(s, "numeric")
    assert agree["severity"] == "info" and agree["data"]["agrees"] and agree["data"]["samples"] == 120 * world
    assert sum(agree["data"]["class_counts"]) == 120 * world
    [val] = [f for f in findings(s, "coverage") if f["data"].get("stage") == "validation"]   # torch < 2.8: + a recorder note
    assert (val["data"]["covered"], val["data"]["dataset_size"]) == (120 * world, 10_000)
    assert val["data"]["limit"] == {"setting": "limit_val_batches", "value": 10}


@check("straggler")
def _straggler(s: dict, world: int) -> None:
    assert s["observed"] == ["straggler"]
    [f] = findings(s, "straggler")
    assert f["odd_ranks"] == [world - 1]
    assert f["data"]["median_lag_s"] >= 0.15
    assert f["data"]["last_in"] >= 0.8 * f["data"]["collectives"]


# -- collectives issued from C++, and late ranks ---------------------------------------------


def _hang_in_cpp(s: dict, waiting: list[int], absent: list[int], op: str, label: str, issuer: str) -> dict:
    """Named from the Flight Recorder where this torch's gloo has one; else (torch < 2.8) from the
    rank's stack: ``issuer`` and an unknown op."""
    if not features().flight_recorder_gloo:
        op, label = UNKNOWN_OP, f"{issuer} (a collective issued from C++"
    [h] = findings(s, "hang")
    assert (h["op"], h["waiting_ranks"], h["absent_ranks"]) == (op, waiting, absent)
    assert h["label"].startswith(label), h["label"]
    assert h["detected_after_s"] <= STALL + 3
    return h


@check("ddp_uneven_inputs")
def _ddp_uneven(s: dict, world: int) -> None:
    h = _hang_in_cpp(s, [0], list(range(1, world)), "all_reduce", "DDP gradient all_reduce, bucket of 5 elements",
                     "DDP's reducer in backward()")
    assert "loss.backward()" in source_line(h["callsite"])
    assert h["seq"] == 8   # the group's own number: 3 init calls, 2 rebuild broadcasts, 1 bucket per step


@check("ddp_no_sync_one_rank")
def _ddp_no_sync(s: dict, world: int) -> None:
    h = _hang_in_cpp(s, list(range(1, world)), [0], "all_reduce", "DDP gradient all_reduce", "DDP's reducer in backward()")
    assert "backward()" in source_line(h["callsite"])


@check("functional_collective_subset")
def _funcol(s: dict, world: int) -> None:
    _hang_in_cpp(s, [0], list(range(1, world)), "all_reduce", "functional collective all_reduce", "functional collective")


@check("fsdp2_extra_step")
def _fsdp2(s: dict, world: int) -> None:
    [h] = findings(s, "hang")
    if h["op"] == "all_gather_into_tensor":   # FSDP2 of torch 2.7-2.9 gathers through the Python API; 2.13 from C++
        assert (h["waiting_ranks"], h["absent_ranks"]) == ([0], list(range(1, world)))
        assert h["label"].endswith(".forward"), h["label"]
        return
    _hang_in_cpp(s, [0], list(range(1, world)), "all_gather", "FSDP all_gather", "FSDP")


@check("ddp_extra_step_then_barrier")
def _ddp_then_barrier(s: dict, world: int) -> None:
    # the cause only: no second finding puts rank 0 (in its all_reduce) in the others' barrier
    [m] = s["findings"]
    assert (m["kind"], m["op"], m["seq"], m["odd_ranks"]) == ("mismatch", "barrier", 8, [0])
    assert "op" in m["fields"]
    assert {r["rank"]: r["state"] for r in s["ranks"]} == {r: "stuck" for r in range(world)}


@check("rank0_slow_then_barrier")
def _late(s: dict, world: int) -> None:
    assert s["observed"] == ["straggler"] and s["end_reason"] == "completed"
    [f] = findings(s, "straggler")
    assert f["odd_ranks"] == [0] and f["waiting_ranks"] == list(range(1, world))
    assert f["data"]["waited_s"] >= BUSY_S - 1
    assert "rank0_slow_then_barrier.py" in f["data"]["busy_at"]
    assert all(r["state"] == "finished" for r in s["ranks"])


# -- issue 17: splits, group members, gloo's own words -----------------------------------------


@check("moe_all_to_all_splits")
def _splits(s: dict, world: int) -> None:
    [m] = findings(s, "mismatch")
    assert (m["fields"], m["op"], m["seq"]) == (["splits"], "all_to_all_single", 1)
    assert m["odd_ranks"] == odd(world)
    pairs = {(p["src"], p["dst"]): (p["sent"], p["expected"]) for p in m["data"]["pairs"]}
    last = world - 1
    assert pairs[(last, 0)] == (320, 128) and pairs[(0, last)] == (128, 320)
    assert f"rank {last} sends 320 elements to rank 0, which expects 128" in m["summary"]
    for crash in findings(s, "crash"):   # gloo aborts the receivers: a consequence, said so
        assert crash["data"]["caused_by"]["fields"] == ["splits"]


@check("subgroups_created_in_different_order")
def _members(s: dict, world: int) -> None:
    [m] = findings(s, "mismatch")
    assert (m["fields"], m["op"], m["seq"], m["group"]) == (["members"], "new_group", 1, "new_group")
    everyone = "[" + ", ".join(map(str, range(world))) + "]"
    assert m["data"]["values"]["members"] == {"[0, 1]": list(range(world - 1)), everyone: [world - 1]}
    # each side's first new_group line: the pair first on most ranks, every rank first on the last one
    lines = Path(builtin_dir(), "_catalogue.py").read_text().splitlines()
    pair_first = next(i for i, line in enumerate(lines, 1) if "pair = dist.new_group([0, 1])" in line)
    # the odd rank's branch (else:) creates the world group first: its second spelling in the helper
    world_first = [i for i, line in enumerate(lines, 1) if "world = dist.new_group(everyone)" in line][1]
    assert f"_catalogue.py:{pair_first}" in m["summary"] and f"_catalogue.py:{world_first}" in m["summary"]


@check("recv_any_source_sizes")
def _backend_words(s: dict, world: int) -> None:
    [m] = findings(s, "mismatch")
    assert (m["fields"], m["op"], m["odd_ranks"]) == (["bytes"], "recv", [world - 1])
    assert m["data"]["receivers"] == {"0": {"received": 388, "expected": 4}}
    assert any(words in m["data"]["backend_error"] for words in SIZE_TEXTS)   # gloo's words differ by torch
    [c] = findings(s, "crash")
    assert c["data"]["root_rank"] == 0 and c["data"]["caused_by"]["fields"] == ["bytes"]


# -- passes, skips and the seeds -----------------------------------------------------------


def _passes(s: dict, world: int) -> None:
    assert s["observed"] == ["pass"] and findings_less_torch_notes(s) == []
    assert all(r["state"] == "finished" for r in s["ranks"])


for _name in ("weighted_mean", "unrepeated_sharding_confmat", "collectives_sanity", "auroc_all_ranks_compute",
              "ddp_uneven_inputs_join", "ddp_no_sync_all_ranks", "functional_collective_all_ranks", "fsdp2_same_steps",
              "moe_all_to_all_splits_exchanged", "ddp_extra_step_then_barrier_join", "subgroups_created_in_same_order", "recv_sized_per_worker",
              "monitored_barrier_every_rank", "pipeline_stages_agree"):
    check(_name)(_passes)


@check("monitored_barrier_skipped_by_one_rank")
def _skipped_monitored_barrier(s: dict, world: int) -> None:
    # gloo's monitored_barrier is P2P with rank 0; the rank that skipped it is the odd one, at its all_reduce
    [m] = findings(s, "mismatch")
    assert m["odd_ranks"] == odd(world) and "op" in m["fields"], m["summary"]
    lines = {d["rank"]: source_line(d["callsite"]) for d in m["ranks"]}
    assert all("monitored_barrier(" in lines[r] for r in range(world - 1)), lines
    assert "dist.all_reduce(t)" in lines[world - 1], lines
    assert not findings(s, "count") and not findings(s, "hang"), s["findings"]


@check("pipeline_stage_splits_differently")
def _pipeline_cannot_finish(s: dict, world: int) -> None:
    # the stages wait on each other's P2P handles: certain, with no time-out, at each rank's schedule.step line
    assert s["end_reason"] == "certain_hang", s["end_reason"]
    hangs = findings(s, "hang")
    cycle = {r for c in hangs[0]["data"]["cycle"] for r in c["ranks"]}
    assert {0, 1} <= cycle, hangs[0]["summary"]
    for h in hangs:
        assert "schedule.step(" in source_line(h["callsite"]), h["summary"]
    assert {r for h in hangs for r in h["waiting_ranks"]} == set(range(world)), [h["summary"] for h in hangs]


@check("cpu_state_on_nccl")
def _nccl_only(s: dict, world: int) -> None:
    assert s["skipped"] and "nccl" in s["skipped"]


@check("auroc_rank0_only_compute")
def _seed(s: dict, world: int) -> None:
    # (was also tests/test_run_e2e.py's seed test, a launch of its own)
    assert s["observed"] == ["hang"]
    [h] = findings(s, "hang")
    assert h["waiting_ranks"] == [0] and h["absent_ranks"] == list(range(1, world))
    assert h["label"] == "BinaryAUROC.compute"
    assert h["op"] in ("barrier", "all_gather") and h["seq"] >= 1
    assert h["callsite"].split(":")[0].endswith("scenarios/auroc_rank0_only_compute.py")
    assert "metric.compute()" in source_line(h["callsite"])
    assert h["detected_after_s"] <= STALL + 3
    ranks = {x["rank"]: x for x in s["ranks"]}
    assert ranks[0]["state"] == "stuck" and all(ranks[i]["state"] == "finished" for i in range(1, world))
    launch = Path(s["launch_dir"])
    assert sorted(p.name for p in (launch / "traces").iterdir()) == [f"rank{i}.trace" for i in range(world)]
    for trace in (launch / "traces").iterdir():   # no preallocated, unwritten end left once the ranks are gone
        data = trace.read_bytes()
        assert data and len(data) % 32 == 0 and data[-32:] != bytes(32), trace.name
    assert (launch / "stacks" / "rank0.txt").read_text().count("barrier") >= 1
    # PyTorch's Flight Recorder, dumped on the stall: rank 0 enqueued the collective, never completed it
    if features().flight_recorder_gloo:   # gloo has none before torch 2.8
        [fr] = ranks[0]["flight_recorder"].values()
        assert fr["last_enqueued_collective"] >= 1 > fr["last_completed_collective"]


# -- the runs ------------------------------------------------------------------------------


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _terminal_says_what_was_duplicated_and_which_entries_are_off(stdout: str, s: dict) -> None:
    text = _plain(stdout)
    assert "2 samples (ids 0, 1) were counted twice" in text
    assert "id 0 (ranks 0, 2), id 1 (ranks 1, 3)" in text
    assert "DistributedSampler padded 10 samples to 12 for 4 ranks" in text
    [n] = findings(s, "numeric")
    for e in n["data"]["differing"]:
        i, j = e["index"]
        assert f"[{i}, {j}] is {e['actual']:g} instead of {e['reference']:g} (+{e['actual'] - e['reference']:g})" in text


@pytest.mark.docs   # the catalogue as the README's first command runs it (4 ranks): the docs lane
@pytest.mark.timeout(HARD_TIMEOUT_4 + 30)
def test_the_whole_catalogue_behaves_as_expected_on_4_gloo_ranks(distcheck):
    # No targets: the whole built-in catalogue, exactly as the "done when" runs it.
    r = distcheck("run", "--nproc-per-node", "4", "--backend", "gloo", "--stall-timeout", str(STALL),
                  "--option", f"busy_s={BUSY_S}", "-v", timeout=HARD_TIMEOUT_4, env=WIDE)   # -v: every finding
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    report = r.report
    assert report["verdict"] == "pass"
    names = tuple(s["name"] for s in report["scenarios"])
    assert sorted(names) == sorted(spec.name for spec in builtin_scenarios())
    assert set(CATALOGUE) <= set(names)
    verify(r, 4, names)
    _terminal_says_what_was_duplicated_and_which_entries_are_off(r.stdout, r.scenario("sampler_padding_confmat"))
    assert "BinaryAUROC.compute" in r.stdout   # the seed hang's label, in the terminal view
    # the seed's cut pass, in the words the terminal uses (tests/test_metrics_reference.py's seed test was this)
    assert ("validation covered 480 of 10,000 samples (4 ranks × 10 batches × 12; limit_val_batches=10)"
            in _plain(r.stdout)), r.stdout[-5000:]


@pytest.mark.timeout(HARD_TIMEOUT_2 + 30)
def test_the_whole_catalogue_behaves_as_expected_on_2_gloo_ranks_in_one_screen(distcheck):
    # On 2 ranks every odd-one-out of the catalogue becomes a tie: no side is blamed. The whole catalogue, as the
    # README's first command runs it on a node of 2 (without -v): exit 0, one screen, no [error] line for a finding
    # a scenario expected (this was a launch of its own in tests/test_cli_reports.py).
    r = distcheck("run", "--nproc-per-node", "2", "--backend", "gloo", "--stall-timeout", str(STALL),
                  timeout=HARD_TIMEOUT_2, env=WIDE)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    names = tuple(s["name"] for s in r.report["scenarios"])
    assert sorted(names) == sorted(spec.name for spec in builtin_scenarios())
    verify(r, 2, tuple(name for name in names if not r.scenario(name)["skipped"] or _lacks_torch_feature(name)),
           checked=CATALOGUE + PASSES_AT_2)
    report = r.report
    assert report["schema"] == "distcheck.report/1" and report["verdict"] == "pass"
    assert report["run"]["world_size"] == 2 and report["run"]["backend"] == "gloo"
    for name in PASSES_AT_2:   # no finding at all, not even a note, and every rank exited 0
        s = r.scenario(name)
        assert s["ok"] and s["observed"] == ["pass"] and s["findings"] == [], (name, s["findings"])
        assert all(x["state"] == "finished" and x["exit_code"] == 0 for x in s["ranks"]), name
    lines = r.stdout.splitlines()
    assert len(lines) <= 60, r.stdout
    assert not [line for line in lines if "[error]" in line], r.stdout
    [verdict] = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert verdict.startswith("PASS  ") and "scenarios behaved as expected" in verdict, r.stdout
    for name in ("ddp_extra_step_then_barrier", "monitored_barrier_skipped_by_one_rank"):   # at 2: a certain hang
        assert r.scenario(name)["expected"] == ["hang"], r.scenario(name)
