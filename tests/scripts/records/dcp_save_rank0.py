"""DDP training, then only rank 0 saves a distributed checkpoint (dcp.save is collective)."""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
if rank == 0:
    dcp.save({"model": model.state_dict()}, checkpoint_id=sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())   # SAVE
dist.destroy_process_group()
