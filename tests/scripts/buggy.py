"""A torchrun-style script with one planted bug: rank 0 alone calls all_reduce; the others never enter it.

They finish and leave, so gloo may end rank 0's wait with "Connection closed by peer" before distcheck
names the hang; either way the diagnosis is the hang at the all_reduce line."""

import os

import torch
import torch.distributed as dist

# The others must not leave while rank 0 is still connecting (a loaded node): then its init fails, not this hang.
os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
dist.init_process_group("gloo")
t = torch.ones(1)
if dist.get_rank() == 0:
    dist.all_reduce(t)  # THE BUG: rank 0 alone
dist.destroy_process_group()
