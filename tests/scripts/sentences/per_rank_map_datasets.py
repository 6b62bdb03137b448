"""An evaluation where each rank builds its own map-style dataset, its shard of 96 samples, indexed from 0 on
every rank, and reads it with a plain DataLoader (no DistributedSampler: the split is in the data). Both ranks
draw indices 0-47, but of different samples: the synced accuracy counts each sample once. Indices alone would
call every sample a duplicate.

--same: every rank builds the whole 96-sample dataset and reads it all (the bug the indices do show).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

SAMPLES, FEATURES, CLASSES = 96, 6, 3


def dataset(shard: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    if shard:
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x[rank::world], y[rank::world]   # this rank's own rows, indexed from 0
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--same", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    metric = MulticlassAccuracy(num_classes=CLASSES)
    with torch.no_grad():
        for x, y in DataLoader(dataset(shard=not args.same), batch_size=8):
            metric.update(model(x), y)
        print("accuracy", metric.compute().item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
