"""mp.spawn, with the metric class defined inside the worker function (it cannot be pickled by
reference); its count state is reduced with "max" instead of "sum". Run as
`distcheck run -- python metric_spawn.py`."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def worker(rank: int, port: int) -> None:
    from torchmetrics import Metric

    class LocalCount(Metric):
        def __init__(self):
            super().__init__()
            self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max")   # should be "sum"

        def update(self, x):
            self.n += x.numel()

        def compute(self):
            return self.n

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = LocalCount()
    for _ in range(2):
        m.update(torch.ones(rank + 1))
    print("value", m.compute())   # 4 synced, 6 in one process
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=WORLD)
