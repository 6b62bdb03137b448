"""Rank 0 issues one more all_reduce than rank 1 and its script ends without ever waiting for the device: on NCCL
the call returned at once and nothing ever blocked on it. It never completed: that is no pass."""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import init  # noqa: E402

init()
for _ in range(3):
    dist.all_reduce(torch.ones(1))
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))   # EXTRA
