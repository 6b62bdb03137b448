"""A torchrun-style script whose rank 0 alone calls a barrier: the others never enter it.
--all: every rank calls it (healthy)."""

import sys

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0 or "--all" in sys.argv:
    dist.barrier()  # BARRIER
dist.destroy_process_group()
