"""DTensor: a tensor sharded over a DeviceMesh of every rank, gathered back with ``full_tensor()``,
then the ranks gather their metrics (``--next all_gather``) or all-reduce their gradients
(``--next all_reduce``).

--only R: only rank R calls full_tensor(). Its functional all_gather, issued from C++, meets the
          others' next call: against their all_gather gloo aborts a rank ("Received data size doesn't
          match expected size"), against their all_reduce it waits forever.
Default: every rank calls it (healthy).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

parser = argparse.ArgumentParser()
parser.add_argument("--only", type=int, default=-1)
parser.add_argument("--next", choices=("all_gather", "all_reduce"), default="all_gather")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
weights = distribute_tensor(torch.arange(8 * world * 11, dtype=torch.float32).reshape(8 * world, 11), mesh, [Shard(0)])
loss = torch.ones(5)
dist.all_reduce(loss)
if args.only < 0 or rank == args.only:
    full = weights.full_tensor()  # FULL
    assert full.shape == (8 * world, 11), full.shape
if args.next == "all_gather":
    metrics = torch.zeros(world * 100)
    dist.all_gather_into_tensor(metrics, torch.full((100,), float(rank)))  # NEXT
else:
    dist.all_reduce(torch.ones(300))  # NEXT
print(f"rank {rank} done", loss.tolist())
dist.destroy_process_group()
