"""A healthy FSDP2 (fully_shard) training loop: 3 steps, then a barrier."""

import torch
import torch.distributed as dist

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:   # torch < 2.6 keeps it under _composable
    from torch.distributed._composable.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.barrier()
dist.destroy_process_group()
