"""The job's process-group timeout (4 s) is shorter than distcheck's --stall-timeout: rank 1 blocks reading a pipe
nobody writes (an uncertain wait: it might still come), rank 0 all_reduces and waits for the device. NCCL's watchdog
ends rank 0 at its timeout, before distcheck would. argv[1]: the pipe."""

import datetime
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import BACKEND, sync  # noqa: E402

if BACKEND == "emulated_nccl":
    from distcheck.testing import emulated_nccl
    emulated_nccl.register()
dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=4))
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    with open(sys.argv[1], "rb") as pipe:   # READ
        pipe.read()
dist.all_reduce(torch.ones(4))   # ALL_REDUCE
sync()
dist.destroy_process_group()
