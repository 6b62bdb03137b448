"""The canonical healthy DDP recipe, as a file: DistributedSampler, 5 steps of DDP, the loss
all-reduced for logging, a barrier, destroy_process_group. Every rank issues the same collectives."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(80, 8), torch.randn(80, 1))
loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(loader):
    if step == 5:
        break
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
dist.barrier()
dist.destroy_process_group()
