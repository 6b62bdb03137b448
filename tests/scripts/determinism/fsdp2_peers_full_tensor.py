"""DTensor's ``full_tensor()`` on rank 0 only, while its peers' FSDP2 pre-forward all-gathers the next
layer: a model sharded with ``fully_shard`` trains a step on every rank, then rank 0 exports a weight
(``full_tensor()``, a functional all_gather issued from C++) and every other rank goes on to the next
step, whose forward all-gathers the first layer's parameters (FSDP2, also issued from C++). The two
all_gathers meet at one number of the group with different sizes and gloo aborts a rank.

--export R: the rank that exports (default 0); --export -1: every rank exports (healthy).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--export", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (world,))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(2):
    if step == 1 and args.export in (-1, rank):
        weight = model[0].weight.full_tensor()  # EXPORT
        assert weight.shape == (8, 8), weight.shape
    loss = model(torch.ones(4, 8)).sum()  # FORWARD
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"rank {rank} done")
dist.destroy_process_group()
