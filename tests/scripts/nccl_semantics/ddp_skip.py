"""DDP where rank 0 has one more batch: its gradient all_reduce (issued from C++ in loss.backward()) is one the
others never enter; then every rank waits for the device before it reads its loss."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import init, sync  # noqa: E402

init()
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3 if rank == 0 else 2):
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad()
    loss.backward()  # BACKWARD
    opt.step()
    sync()
print(rank, "done")
