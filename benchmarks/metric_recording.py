"""Cost of recording torchmetrics update() inputs (issue 13): µs per update() and memory per 1,000 updates.

Plain vs recorded MulticlassConfusionMatrix(num_classes=10) over batches of 64 (preds, target),
interleaved rounds, medians. Run: python benchmarks/metric_recording.py
"""

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torchmetrics.classification import MulticlassConfusionMatrix

from distcheck.rank import metrics

BATCH, UPDATES, ROUNDS = 64, 1000, 5


def timed(metric, data) -> float:
    t = time.perf_counter()
    for p, y in data:
        metric.update(p, y)
    return (time.perf_counter() - t) / len(data) * 1e6


def main() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 10, (BATCH,), generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(UPDATES)]
    plain_metric = MulticlassConfusionMatrix(num_classes=10)     # created before recording: never recorded
    metrics.install(Path(tempfile.mkdtemp()))
    import torchmetrics.metric
    metrics._patch_metric(torchmetrics.metric)
    plain, recorded = [], []
    for _ in range(ROUNDS):
        plain.append(timed(plain_metric, data))
        m = MulticlassConfusionMatrix(num_classes=10)
        before = metrics.RECORDER.bytes
        recorded.append(timed(m, data))
        held = metrics.RECORDER.bytes - before
        metrics.RECORDER.drain()
    p, r = statistics.median(plain), statistics.median(recorded)
    print(f"update(): plain {p:.1f} µs, recorded {r:.1f} µs (+{r - p:.1f} µs per update); "
          f"inputs held: {held / 2**20:.2f} MiB per 1,000 updates of 2 × {BATCH} int64")
    print(f"conditions: Python {platform.python_version()}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
