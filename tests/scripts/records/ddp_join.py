"""DDP with Join, the documented fix for uneven inputs: rank r trains 3 + r steps. Healthy."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Join([model]):
    for _ in range(3 + rank):
        loss = model(torch.randn(4, 6)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
dist.barrier()
dist.destroy_process_group()
