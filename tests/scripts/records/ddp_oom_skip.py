"""One rank catches a (simulated) CUDA OOM in forward, skips backward() and goes on to the
loss-logging all_reduce of 1 element, while its peers are in DDP's gradient all_reduce of the
577-element bucket. gloo aborts a rank on the size mismatch."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))   # 577 parameters
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    try:
        if rank == 1 and step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        loss = model(torch.randn(4, 16)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    except torch.OutOfMemoryError:
        loss = torch.zeros(())   # skip this batch
    logged = loss.detach().clone()
    dist.all_reduce(logged)   # LOGGING
dist.destroy_process_group()
