"""A long job: 1,500 all_reduces per rank, more than a node sends node 0 whole on a multi-node run.
With PLANT_MAX=1 the last rank reduces call #300 with MAX where every other rank sums: a mismatched
reduction long before the end of the run."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
planted = os.environ.get("PLANT_MAX") == "1" and rank == world - 1
t = torch.ones(1)
for call in range(1, 1501):
    dist.all_reduce(t, op=dist.ReduceOp.MAX if planted and call == 300 else dist.ReduceOp.SUM)
    t.fill_(1.0)
dist.destroy_process_group()
