"""60 compute() calls of one metric (a reset every 10): the check covers the first, the last and a
spread between. --wrong-reduce: beside it, the same metric whose count is reduced with "max" from the start."""

import sys

import torch
import torch.distributed as dist
from torchmetrics import Metric

WRONG = "--wrong-reduce" in sys.argv


class Total(Metric):
    def __init__(self, wrong=False):
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max" if wrong else "sum")

    def update(self, x):
        self.total += x.sum()
        self.n += x.numel()

    def compute(self):
        return self.total / self.n


dist.init_process_group("gloo")
rank = dist.get_rank()
metrics = [Total()] + ([Total(wrong=True)] if WRONG else [])
for step in range(60):
    for m in metrics:
        if step % 10 == 0:
            m.reset()
        m.update(torch.full((rank + 1,), float(step)))
        m.compute()
dist.destroy_process_group()
