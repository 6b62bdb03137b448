"""A torchrun-style training script (it calls init_process_group itself): a small DDP model on CPU.

    distcheck run train.py --nproc-per-node 4 -- --steps 8
    distcheck run -- torchrun --nproc-per-node 4 train.py --steps 12
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--config", default=None, help="a config file (this example only names it)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.3f}" + (f" ({args.config})" if args.config else ""), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
