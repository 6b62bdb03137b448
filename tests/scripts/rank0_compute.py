"""A torchrun-style eval script with the seed bug: only rank 0 calls compute()."""

import argparse

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compute-at", type=int, default=5)
    p.add_argument("--fixed", action="store_true", help="every rank calls compute()")
    p.add_argument("--forever", action="store_true", help="keep evaluating until stopped")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} evaluating", flush=True)
    metric = BinaryAUROC(thresholds=50)
    it = 0
    while args.forever or it < args.steps:
        preds, target = torch.rand(16), torch.randint(0, 2, (16,))
        metric.update(preds, target)
        if it % args.compute_at == 0 and (args.fixed or rank == 0):
            value = metric.compute()
            if rank == 0:
                print(f"step {it}: auroc {value:.3f}")
        it += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
