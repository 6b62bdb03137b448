"""torchmetrics under a plain torchrun-style script (run under distcheck in the tests).

default: a MulticlassConfusionMatrix and a MetricCollection (compute groups) over sharded data — healthy.
--wrong-reduce: a custom mean whose count state uses dist_reduce_fx="max" — the synced mean is wrong.
--no-sync: an accuracy with sync_on_compute=False over rank-dependent data — ranks disagree (with both: both).
"""

import argparse

import torch
import torch.distributed as dist
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassPrecision


class CountedMean(Metric):
    """A mean kept as (total, count); the bug: count is reduced with max instead of sum."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="max")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.sum()
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count


def batches(rank: int, world: int, n: int = 24, batch: int = 4):
    g = torch.Generator().manual_seed(0)
    preds, target = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)
    ids = list(range(rank, n, world))     # a disjoint shard per rank
    for i in range(0, len(ids), batch):
        yield preds[ids[i:i + batch]], target[ids[i:i + batch]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--wrong-reduce", action="store_true")
    p.add_argument("--no-sync", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.wrong_reduce:
        metric = CountedMean()
        for preds, _ in batches(rank, world):
            metric.update(preds.float())
        print("mean", metric.compute())
    if args.no_sync:
        metric = MulticlassAccuracy(num_classes=3, sync_on_compute=False)
        for preds, target in batches(rank, world):
            metric.update(preds, target)
        print("accuracy", metric.compute())
    if not (args.wrong_reduce or args.no_sync):
        confmat = MulticlassConfusionMatrix(num_classes=3)
        collection = MetricCollection([MulticlassAccuracy(num_classes=3), MulticlassPrecision(num_classes=3)])
        for preds, target in batches(rank, world):
            confmat.update(preds, target)
            collection.update(preds, target)
        print("confmat", confmat.compute().tolist(), collection.compute())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
