"""Rank 0 calls a ProcessGroup method directly (C++, no torch.distributed function): the
others never join. --all: every rank calls it (healthy)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
pg = dist.group.WORLD
t = torch.ones(3)
if dist.get_rank() == 0 or "--all" in sys.argv:
    pg.allreduce([t]).wait()  # DIRECT
