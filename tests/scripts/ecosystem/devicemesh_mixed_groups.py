"""DeviceMesh (2, 2) over 4 ranks, dimensions "dp" and "tp": each step all-reduces the loss over "dp",
then the activations over "tp".

--odd R: rank R all-reduces its loss over "tp" instead of "dp" (every group waits on another: a cycle);
         default: every rank follows the same pattern (healthy).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

parser = argparse.ArgumentParser()
parser.add_argument("--odd", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
for step in range(2):
    loss, act = torch.ones(4), torch.ones(4)   # one shape: a group mixed up pairs them silently
    dist.all_reduce(loss, group=tp if rank == args.odd else dp)  # LOSS
    dist.all_reduce(act, group=tp)  # ACT
print(f"rank {rank} done")
dist.destroy_process_group()
