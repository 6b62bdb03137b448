"""Four ranks: ranks 0-2 all_reduce and then wait for the device; rank 3 blocks reading a pipe nobody writes (a
stuck file-system read): no CPU, no I/O, no progress. argv[1]: the pipe."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import init, sync  # noqa: E402

init()
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 3:
    with open(sys.argv[1], "rb") as pipe:   # READ
        pipe.read()
grads = torch.ones(4)
dist.all_reduce(grads)   # ALL_REDUCE
sync()   # SYNC
print(grads.tolist())
dist.destroy_process_group()
