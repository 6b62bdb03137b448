"""Issue 41 item 5: every recorder in the user's process keeps bounded memory and says when a cap was reached.

The recorders patch torch's DataLoader and torchmetrics process-wide, so each case runs in a fresh
interpreter (``python -c``), on real DataLoaders and real torchmetrics metrics. The benchmark's tiny
configuration (real 2-rank gloo jobs with and without distcheck) runs in tests/test_benchmarks.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib
from array import array
from pathlib import Path

from distcheck.rank.row_digests import RowDigests, digest_rows


def _python(code: str, tmp_path: Path, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


LOADERS = """
import gc, json, sys, weakref, torch
from pathlib import Path
from torch.utils.data import DataLoader, TensorDataset
from distcheck.rank import guard
from distcheck.rank.samples import SampleRecorder
path = Path(sys.argv[1]) / "samples.jsonl"
recorder = SampleRecorder(path)
recorder.install()
data = TensorDataset(torch.arange(100))
first = None
for i in range(300):          # a new loader for every evaluation pass, as many training loops make them
    loader = DataLoader(data, batch_size=10)
    first = first or weakref.ref(loader)
    for _ in loader:
        pass
gc.collect()
lines = [json.loads(l) for l in path.read_text().splitlines()]
print(json.dumps({"loaders": len(recorder._loaders), "open": len(recorder._open), "kept": len(recorder._done),
                  "first_freed": first() is None, "lines": len(lines), "names": [l["dataset"] for l in lines[-2:]],
                  "last": {k: lines[-1][k] for k in ("complete", "ids_capped")}, "kept_ids": len(lines[-1]["ids"]),
                  "failures": guard.failures()}))
"""


def test_the_sample_recorder_keeps_no_loader_and_no_written_pass(tmp_path):
    out = _python(LOADERS, tmp_path, {"DISTCHECK_SAMPLES_MAX_IDS": "50"})
    assert out["first_freed"] and out["loaders"] <= 2 and out["open"] == 0 and out["kept"] == 0
    assert out["lines"] == 300   # every pass written as it ended, none held
    assert out["names"] == ["TensorDataset (loader 298, pass 0)", "TensorDataset (loader 299, pass 0)"]
    # past the cap the pass keeps 50 of its 100 indices and is accounted like a cut pass, said once
    assert out["last"] == {"complete": False, "ids_capped": 100} and out["kept_ids"] == 50
    assert list(out["failures"]) == ["samples_cap"] and out["failures"]["samples_cap"]["count"] == 1
    assert "DISTCHECK_SAMPLES_MAX_IDS" in out["failures"]["samples_cap"]["error"]


METRICS = """
import gc, json, sys, weakref, torch
from pathlib import Path
from distcheck.rank import guard, metrics
metrics.install(Path(sys.argv[1]) / "metrics")
import torchmetrics.metric
metrics._patch_metric(torchmetrics.metric)
from torchmetrics.classification import MulticlassAccuracy
metrics.MAX_ENTRIES, metrics.FLUSH_BYTES = 200, 1024
g = torch.Generator().manual_seed(0)
refs = []
for i in range(300):          # a new metric for every evaluation pass, dropped after it
    metric = MulticlassAccuracy(num_classes=3)
    refs.append(weakref.ref(metric))
    for _ in range(4):
        metric.update(torch.randn(64, 3, generator=g), torch.randint(0, 3, (64,), generator=g))
    metric.compute()
del metric
gc.collect()
recorder = metrics.RECORDER
pending = max(e.pending_bytes for e in [*recorder.retired, *recorder.entries.values()])
drained = metrics.results()["metrics"]
print(json.dumps({"alive": sum(r() is not None for r in refs), "recorded": len(drained), "pending": pending,
                  "chunks": len(drained[0]["chunks"]), "rows": drained[0]["rows"]["0"]["rows"],
                  "digests": len(drained[0]["rows"]["0"]["digests"]), "failures": guard.failures()}))
"""


def test_the_metric_recorder_frees_metrics_flushes_inputs_and_caps_objects(tmp_path):
    out = _python(METRICS, tmp_path)
    assert out["alive"] == 0   # recording kept none of the user's metrics alive
    assert out["recorded"] == 200 and list(out["failures"]) == ["metrics_cap"]
    assert "more than 200 torchmetrics objects" in out["failures"]["metrics_cap"]["error"]
    # 4 updates of 64 rows: inputs written out as they passed 1 KiB, not held until compute()
    assert out["chunks"] >= 4 and out["pending"] == 0
    assert out["rows"] == out["digests"] == 256


COMPUTES = """
import json, sys, torch
from pathlib import Path
from distcheck.rank import guard, metrics
from distcheck.files.metric_records import with_spilled_computes
folder = Path(sys.argv[1]) / "metrics"
metrics.install(folder)
import torchmetrics.metric
metrics._patch_metric(torchmetrics.metric)
from torchmetrics.classification import MulticlassAccuracy
metric = MulticlassAccuracy(num_classes=3)   # one metric over a long run: an evaluation pass, compute(), reset()
g = torch.Generator().manual_seed(0)
values, held = [], 0
for i in range(300):
    metric.update(torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g))
    values.append(round(float(metric.compute()), 6))
    metric.reset()
    held = max(held, sum(len(e.computes) for e in metrics.RECORDER.entries.values()))
results = metrics.results()
kept = len(results["metrics"][0]["computes"])
read = with_spilled_computes(results, folder)["metrics"][0]
print(json.dumps({"held": held, "kept": kept, "read": [round(c["value"], 6) for c in read["computes"]],
                  "epochs": [c["epoch"] for c in read["computes"]], "values": values, "note": read["note"],
                  "failures": guard.failures()}))
"""


def test_compute_records_go_to_disk_as_a_long_run_makes_them_and_come_back_whole(tmp_path):
    """A metric computed after each of 300 passes: the rank holds at most SPILL_COMPUTES records; every one
    comes back, in order, with its value, when its status is read."""
    from distcheck.rank.metrics import SPILL_COMPUTES

    out = _python(COMPUTES, tmp_path)
    assert out["held"] <= SPILL_COMPUTES < 300 and out["kept"] < SPILL_COMPUTES
    assert out["read"] == out["values"] and out["epochs"] == list(range(300))
    assert out["note"] is None and out["failures"] == {}


def test_row_digests_of_the_same_rows_agree_whatever_the_batch_layout_or_copy():
    import torch

    from distcheck.files.metric_records import pack

    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(10, 3, generator=g), torch.randint(0, 3, (10,), generator=g)
    before = preds.clone()
    whole, rows = digest_rows(((preds, target), {}), torch.Tensor)
    assert rows == 10 and len(set(whole)) == 10
    halves = digest_rows(((preds[:4], target[:4]), {}), torch.Tensor)[0] + \
        digest_rows(((preds[4:], target[4:]), {}), torch.Tensor)[0]
    assert halves == whole
    assert digest_rows(((pack(preds), pack(target)), {}))[0] == whole   # the recorder's copies give the same
    transposed = preds.t().contiguous().t()   # the same values, strided
    assert digest_rows(((transposed, target), {}), torch.Tensor)[0] == whole
    # a keyword and a per-update constant (no batch dimension) change nothing
    assert digest_rows(((preds,), {"target": target, "threshold": torch.tensor(0.5)}), torch.Tensor)[0] == whole
    assert torch.equal(preds, before)


def test_past_the_digest_cap_every_rank_keeps_the_same_sample_of_rows():
    rnd = random.Random(0)
    digests = array("I", (zlib.crc32(rnd.randbytes(8)) for _ in range(5000)))
    small, large = RowDigests(64), RowDigests(100_000)
    s, l = small.stream(), large.stream()
    for i in range(0, 5000, 100):
        small.add(s, digests[i:i + 100], 100)
        large.add(l, digests[i:i + 100], 100)
    assert small.level > 0 and small.kept <= 64 and s["rows"] == 5000
    mask = (1 << small.level) - 1
    assert s["digests"] == array("I", (d for d in l["digests"] if not d & mask))
    saved = small.saved(s)
    assert saved["level"] == small.level and saved["rows"] == 5000
