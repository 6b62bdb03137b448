"""The issue's DDP script: rank 0 has one more batch, so it waits in DDP's gradient all_reduce
(issued from C++ during loss.backward()) that the other ranks never enter.
--even: every rank trains the same steps, then a barrier (healthy). --unused: find_unused_parameters."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1), find_unused_parameters="--unused" in sys.argv)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 3 if rank == 0 and "--even" not in sys.argv else 2
for i in range(steps):
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad(); loss.backward(); opt.step()  # BACKWARD
if "--even" in sys.argv:
    dist.barrier()
    print(f"rank {rank}: barrier #{dist.group.WORLD._get_sequence_number_for_group()}")
