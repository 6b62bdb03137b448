"""An evaluation over an IterableDataset that is not split by rank, run before the ranks' models were
synchronised: every rank reads the whole stream of 96 samples (the same inputs and labels), but each
rank's model has its own random weights, so the predictions it feeds MulticlassAccuracy differ from
the other ranks'. Only the samples the ranks read show that the synced accuracy counts every sample
world_size times.

--shard: each rank takes every world_size-th sample from its rank (a disjoint shard): healthy.
"""

import argparse
import itertools

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics.classification import MulticlassAccuracy

SAMPLES, FEATURES, CLASSES = 96, 6, 3


class EvalStream(IterableDataset):
    def __init__(self, shard: bool) -> None:
        self.shard = shard

    def samples(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(SAMPLES):
            yield torch.randn(FEATURES, generator=g), torch.randint(0, CLASSES, (), generator=g)

    def __iter__(self):
        if not self.shard:
            return self.samples()   # the bug: no split by rank
        return itertools.islice(self.samples(), dist.get_rank(), None, dist.get_world_size())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())   # each rank's own weights: not synchronised yet
    model = torch.nn.Linear(FEATURES, CLASSES)
    metric = MulticlassAccuracy(num_classes=CLASSES)
    with torch.no_grad():
        for x, y in DataLoader(EvalStream(args.shard), batch_size=8):
            metric.update(model(x), y)
        print("accuracy", metric.compute().item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
