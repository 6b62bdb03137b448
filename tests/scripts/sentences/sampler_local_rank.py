"""An evaluation sharded with a DistributedSampler told rank=args.local_rank: torchrun passes no --local-rank
(it sets LOCAL_RANK), so the flag keeps its default 0 on every rank and every rank draws shard 0. The sampler is
there; its rank= is what is wrong, on the line that makes it.

--right: rank=dist.get_rank() (healthy).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import MulticlassAccuracy

SAMPLES, FEATURES, CLASSES = 96, 6, 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--right", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    rank = dist.get_rank() if args.right else args.local_rank
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=rank, shuffle=False)  # SAMPLER
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    metric = MulticlassAccuracy(num_classes=CLASSES)
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=8, sampler=sampler):
            metric.update(model(x), y)
        print("accuracy", metric.compute().item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
