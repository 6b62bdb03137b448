"""Every rank enters the same all_reduce and none completes (a link that went down: the emulated device runs
nothing from the call on); each host waits for the device."""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _backend import BACKEND, init, sync  # noqa: E402

init()
dist.all_reduce(torch.ones(1))
if BACKEND == "emulated_nccl":
    from distcheck.testing import emulated_nccl
    emulated_nccl.link_down()
dist.all_reduce(torch.ones(8))   # ALL_REDUCE
sync()   # SYNC
dist.destroy_process_group()
