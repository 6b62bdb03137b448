"""Rank 0 all_reduces 10 elements, rank 1 12 (a length computed per rank), then both wait for the device."""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import init, sync  # noqa: E402

init()
t = torch.ones(10 if dist.get_rank() == 0 else 12)
dist.all_reduce(t)   # ALL_REDUCE
sync()   # SYNC
print(t.sum().item())
dist.destroy_process_group()
