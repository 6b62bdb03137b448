"""An evaluation over an IterableDataset under a plain torchrun-style script (run under distcheck in the tests).

default: the stream is not split by rank, so every rank evaluates all 120 samples, in 3 evaluation passes.
--shard: each rank takes every world_size-th sample from its rank (a disjoint shard) — healthy.
Half of the samples are all-zero inputs, so many rows the metric is fed are identical, on every rank.
"""

import argparse
import itertools

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics.classification import MulticlassAccuracy

SAMPLES, FEATURES, CLASSES = 120, 6, 3


class EvalStream(IterableDataset):
    def __init__(self, shard: bool) -> None:
        self.shard = shard

    def samples(self):
        g = torch.Generator().manual_seed(0)
        for i in range(SAMPLES):
            x = torch.randn(FEATURES, generator=g)
            yield (torch.zeros(FEATURES) if i % 2 else x), torch.randint(0, CLASSES, (), generator=g)

    def __iter__(self):
        if not self.shard:
            return self.samples()
        return itertools.islice(self.samples(), dist.get_rank(), None, dist.get_world_size())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)   # the same weights on every rank
    model = torch.nn.Linear(FEATURES, CLASSES)
    metric = MulticlassAccuracy(num_classes=CLASSES)
    loader = DataLoader(EvalStream(args.shard), batch_size=8)
    with torch.no_grad():
        for _ in range(3):   # three evaluation passes, reset between them
            for x, y in loader:
                metric.update(model(x), y)
            print("accuracy", metric.compute().item())
            metric.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
