"""Healthy: rank 0 writes a file in small chunks at low CPU for SECONDS (argv[1]) before the barrier."""

import os
import sys
import tempfile
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    end = time.monotonic() + float(sys.argv[1])
    with tempfile.TemporaryFile() as f:
        while time.monotonic() < end:
            f.write(os.urandom(4096))
            f.flush()
            time.sleep(0.05)   # a slow disk
dist.barrier()
