"""Healthy: rank 0 downloads URL (argv[1]) from a slow server before the barrier."""

import sys
import urllib.request

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    with urllib.request.urlopen(sys.argv[1], timeout=60) as response:
        while response.read(1024):   # DOWNLOAD
            pass
dist.barrier()
