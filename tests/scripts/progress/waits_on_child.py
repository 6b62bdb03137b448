"""Healthy: rank 0 waits for a child process that computes for SECONDS (argv[1]), then the barrier."""

import subprocess
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    busy = f"import time\nend = time.monotonic() + {float(sys.argv[1])}\nwhile time.monotonic() < end: pass\n"
    subprocess.run([sys.executable, "-c", busy], check=True)   # CHILD
dist.barrier()
