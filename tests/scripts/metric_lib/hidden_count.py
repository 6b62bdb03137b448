"""A metric in a module that is loaded from its path and is importable under no name (metric_hidden.py)."""

import torch
from torchmetrics import Metric

OFFSET = 0   # a module global the metric reads: taken with the class, by value


class HiddenCount(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max")   # should be "sum"

    def update(self, x):
        self.n += x.numel() + OFFSET

    def compute(self):
        return self.n
