"""Cost of recording torchmetrics update() inputs (issue 13): µs per update() and memory per 1,000 updates.

Plain vs recorded MulticlassConfusionMatrix(num_classes=10) over batches of 64 (preds, target),
interleaved rounds, medians.

    python benchmarks/metric_recording.py [--updates 1000] [--rounds 5] [--tiny]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torchmetrics.classification import MulticlassConfusionMatrix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import conditions, parse_args, well_formed  # noqa: E402

from distcheck.rank import metrics  # noqa: E402

BATCH = 64
TINY = {"updates": 20, "rounds": 1}


def timed(metric, data) -> float:
    t = time.perf_counter()
    for p, y in data:
        metric.update(p, y)
    return (time.perf_counter() - t) / len(data) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=1000, help="update() calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = parse_args(ap, TINY)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 10, (BATCH,), generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(args.updates)]
    plain_metric = MulticlassConfusionMatrix(num_classes=10)     # created before recording: never recorded
    metrics.install(Path(tempfile.mkdtemp()))
    import torchmetrics.metric
    metrics._patch_metric(torchmetrics.metric)
    plain, recorded = [], []
    for _ in range(args.rounds):
        plain.append(timed(plain_metric, data))
        m = MulticlassConfusionMatrix(num_classes=10)
        before = metrics.RECORDER.bytes
        recorded.append(timed(m, data))
        held = metrics.RECORDER.bytes - before
        metrics.RECORDER.drain()
    p, r = statistics.median(plain), statistics.median(recorded)
    per_1000 = held / 2**20 * 1000 / args.updates
    print(f"update(): plain {p:.1f} µs, recorded {r:.1f} µs (+{r - p:.1f} µs per update); "
          f"inputs held: {per_1000:.2f} MiB per 1,000 updates of 2 × {BATCH} int64")
    print(f"conditions: {conditions()}")
    # Each update's inputs are 2 × BATCH int64: a recorder that held less than that recorded nothing.
    well_formed({"plain_us": p, "recorded_us": r, "held_mib_per_1000": per_1000},
                {"inputs recorded": held >= args.updates * 2 * BATCH * 8})


if __name__ == "__main__":
    main()
