"""Issue 41 item 10: duplicates seen in the data a synced metric was fed, where no sampler tells.

Pure tests of the rule on synthetic records (``diagnose.duplicates.find_fed_duplicates``), real digests of
real tensors (``rank.row_digests``), then a real 3-rank gloo script over an unsharded IterableDataset.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from conftest import findings_less_torch_notes
from distcheck.diagnose.duplicates import fed_overlap, find_duplicates, find_fed_duplicates

SCRIPTS = Path(__file__).parent / "scripts"
E2E_TIMEOUT = 180


def _digests(values) -> list[int]:
    """Digests as the recorder makes them: one CRC-32 per row (here a row is its value's text)."""
    return [zlib.crc32(str(v).encode()) for v in values]


def _stream(values, t0=50.0, level=0, rows=None):
    digests = [d for d in _digests(values) if not d & ((1 << level) - 1)]
    return {"t0": t0, "rows": len(values) if rows is None else rows, "level": level, "digests": digests}


def _results(per_rank_values, samples=None, line=41, **stream_kw):
    """Records of one MulticlassAccuracy per rank, synced together once, fed ``per_rank_values[r]`` rows."""
    world = len(per_rank_values)
    results = {}
    for r, values in enumerate(per_rank_values):
        sync = {"ranks": list(range(world)), "seq": 4, "after": 7, "group_rank": r, "rank": r, "t0": 100.0,
                "t1": 100.2}
        entry = {"id": "m0", "class": "MulticlassAccuracy", "qualname": "MulticlassAccuracy", "collection": False,
                 "sync_on_compute": True, "fresh": None, "chunks": [], "updates": 4, "note": None,
                 "computes": [{"epoch": 0, "updates": 4, "callsite": f"/home/u/eval.py:{line}:evaluate",
                               "value": 0.5, "sync": sync}],
                 "rows": {"0": _stream(values, **stream_kw)}}
        results[r] = {"metrics": [entry], **({"samples": samples[r]} if samples else {})}
    return results


def _logits(ids):
    """Rows of a model's output for sample ids: distinct floats per sample, the same on every rank."""
    return [(round(random.Random(i).gauss(0, 1), 6), i % 3) for i in ids]


def test_every_rank_fed_the_whole_unsplit_stream_is_an_error_naming_rows_and_samples():
    rows = _logits(range(60))
    [f] = find_fed_duplicates(_results([rows, rows, rows]), 3)
    assert (f.kind, f.severity, f.odd_ranks) == ("duplicates", "error", (0, 1, 2))
    assert f.data["same_on_every_rank"] and f.data["fed"]
    assert "each of its 3 ranks fed its update() the same 60 rows" in f.summary and "counted 180 rows for 60 samples" in f.summary
    assert "eval.py:41" in f.summary and "DistributedSampler" in f.summary
    # find_duplicates says it too (where the sampler-based rule has nothing)
    assert [g.summary for g in find_duplicates(_results([rows, rows, rows]), 3)] == [f.summary]


def test_a_properly_sharded_dataset_of_many_identical_rows_is_no_finding():
    # Half of the dataset is one all-zero row, the rest distinct: each rank gets a disjoint third.
    data = [(0.0, 0)] * 300 + _logits(range(300))
    random.Random(1).shuffle(data)
    shards = [data[r::3] for r in range(3)]
    assert find_fed_duplicates(_results(shards), 3) == []


def test_a_small_label_space_sharded_or_sorted_is_no_finding():
    rnd = random.Random(2)
    labels = [(rnd.randrange(3), rnd.randrange(3)) for _ in range(600)]   # 9 possible rows
    assert find_fed_duplicates(_results([labels[0::2], labels[1::2]]), 2) == []
    # sorted by class, round-robin shards with a perfect model: both ranks' streams are equal, but in two runs
    ordered = [(c, c) for c in (0, 1) for _ in range(100)]
    assert find_fed_duplicates(_results([ordered[0::2], ordered[1::2]]), 2) == []


def test_the_same_stream_of_repeating_rows_on_every_rank_is_only_a_warning():
    rnd = random.Random(3)
    labels = [(rnd.randrange(3), rnd.randrange(3)) for _ in range(60)]
    [f] = find_fed_duplicates(_results([labels, labels]), 2)
    assert f.severity == "warning" and "may be the data itself" in f.summary


def test_two_ranks_reading_the_same_shard_are_named_and_the_third_is_not():
    shared, own = _logits(range(100)), _logits(range(100, 200))
    [f] = find_fed_duplicates(_results([shared, shared, own]), 3)
    assert f.severity == "error" and f.odd_ranks == (0, 1)
    assert f.data["share"] == {"0": 1.0, "1": 1.0, "2": 0.0}


def test_a_few_rows_in_common_are_an_info_line():
    common = _logits(range(15))
    a, b = common + _logits(range(100, 185)), common + _logits(range(200, 285))
    [f] = find_fed_duplicates(_results([a, b]), 2)
    assert f.severity == "info" and "only a note" in f.summary


def test_a_sampler_tells_for_a_map_style_pass_and_not_for_an_iterable_one():
    rows = _logits(range(60))
    map_pass = {"dataset": "TensorDataset (loader 0, pass 0)", "dataset_size": 60, "ids": list(range(60)),
                "complete": True, "t_start": 10.0}
    iterable = {"dataset": "Stream (loader 1, pass 0)", "iterable": True, "t_start": 20.0}
    assert find_fed_duplicates(_results([rows, rows], samples=[[map_pass], [map_pass]]), 2) == []
    [f] = find_fed_duplicates(_results([rows, rows], samples=[[map_pass, iterable], [map_pass, iterable]]), 2)
    assert f.severity == "error"
    # a scenario's own record (no start time) tells for the whole launch
    own = {"dataset": "d", "dataset_size": 60, "ids": list(range(30))}
    assert find_fed_duplicates(_results([rows, rows], samples=[[own], [own]]), 2) == []


def test_streams_kept_at_different_sampling_levels_are_compared_at_the_highest():
    rows = _logits(range(2000))
    low, high = _stream(rows, level=0), _stream(rows, level=3)
    verdict = fed_overlap({0: low, 1: high})
    assert verdict["severity"] == "error" and verdict["sampled"] and verdict["share"] == {0: 1.0, 1: 1.0}
    assert verdict["distinct_rows"][0] == len(high["digests"])


def test_too_few_distinct_rows_say_nothing():
    rows = _logits(range(8))
    assert find_fed_duplicates(_results([rows, rows]), 2) == []


# -- real gloo ranks ------------------------------------------------------------------------------


def _findings(r, kind):
    [s] = r.report["scenarios"]
    return [f for f in findings_less_torch_notes(s) if f["kind"] == kind]


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_an_unsplit_iterable_stream_is_duplicates_in_every_evaluation(distcheck):
    r = distcheck("run", str(SCRIPTS / "iterable_eval.py"), "--nproc-per-node", "3", timeout=E2E_TIMEOUT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    [d] = _findings(r, "duplicates")
    assert d["severity"] == "error" and d["data"]["fed"] and d["data"]["same_on_every_rank"]
    assert d["data"]["evaluations"] == d["data"]["evaluations_checked"] == 3
    assert "counted 360 rows for 120 samples" in d["summary"] and "iterable_eval.py:48" in d["summary"]


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT + 30)
def test_the_same_stream_split_by_rank_passes_though_many_rows_are_alike(distcheck):
    # Every rank its own shard; half of the rows are still the same all-zero input, on every rank.
    r = distcheck("run", str(SCRIPTS / "iterable_eval.py"), "--nproc-per-node", "3", "--", "--shard",
                  timeout=E2E_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert _findings(r, "duplicates") == []
    [agree] = _findings(r, "numeric")
    assert agree["data"]["agrees"] and agree["data"]["samples"] == 120
