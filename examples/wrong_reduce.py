"""Issue 22's script as a user writes it: no main guard, init_process_group at the top level,
a user metric whose count state is reduced with "max" instead of "sum"."""
import torch
import torch.distributed as dist
from torchmetrics import Metric


class SampleCount(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max")   # should be "sum"
    def update(self, x): self.n += x.numel()
    def compute(self): return self.n


dist.init_process_group("gloo")
m = SampleCount()
for _ in range(3): m.update(torch.ones(dist.get_rank() + 1))
value = m.compute()
print("value", value)
dist.destroy_process_group()
