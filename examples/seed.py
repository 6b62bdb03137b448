"""The bug distcheck was made for: after training, only rank 0 computes the validation AUROC. torchmetrics'
compute() syncs (a barrier, then all_gathers) and waits for ranks that never come.

    distcheck run -- torchrun --nproc-per-node 4 seed.py --steps 12      # a hang, named at once (exit 1)
"""

import argparse

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metric = BinaryAUROC(thresholds=50)
    for _ in range(args.steps):
        metric.update(torch.rand(16), torch.randint(0, 2, (16,)))
    if rank == 0:   # the bug: every rank must call compute()
        print(f"val auroc {metric.compute():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
