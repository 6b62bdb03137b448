"""Rank 0 waits on the job's store for a key no peer ever sets (a hand-rolled barrier): it times out
outside any collective, after its peers finished."""
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(2))
if dist.get_rank() == 0:
    dist.distributed_c10d._get_default_store().wait(["ready"], timedelta(seconds=2))  # WAIT
dist.destroy_process_group()
