"""Rank 0 all_reduces, then blocks in a device sync (as at loss.item()); rank 1 never calls it and finishes.
On NCCL the all_reduce returns at once: rank 0 is blocked at its sync line and the call never completes."""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import init  # noqa: E402

init()
loss = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(torch.ones(1))   # both ranks
if dist.get_rank() == 0:
    dist.all_reduce(loss)   # ALL_REDUCE
    print("loss", loss.item())   # SYNC
dist.destroy_process_group()
