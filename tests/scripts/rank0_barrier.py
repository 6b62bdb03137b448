"""A torchrun-style script whose rank 0 alone calls a barrier: the others never enter it.
--all: every rank calls it (healthy)."""

import os
import sys

import torch.distributed as dist

# The others must not leave while rank 0 is still connecting: on a loaded node gloo then fails rank 0's
# init_process_group ("Connection closed by peer"), and the job is a crash, not this hang.
os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
dist.init_process_group("gloo")
if dist.get_rank() == 0 or "--all" in sys.argv:
    dist.barrier()  # BARRIER
dist.destroy_process_group()
