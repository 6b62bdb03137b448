"""Rank 0 sleeps outside every collective; rank 1 waits in a barrier: a stall. When distcheck ends the job, rank 0's
SIGTERM handler (a job that saves or agrees to stop on pre-emption) issues a broadcast of its own, after the verdict
was decided: it must not change who waited where."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def on_sigterm(signum, frame):
    dist.broadcast(torch.ones(1), src=0)   # HANDLER
    sys.exit(143)


if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:   # srun started every rank (tests/test_slurm_e2e.py)
    dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 0:
    signal.signal(signal.SIGTERM, on_sigterm)
    time.sleep(3600)   # ASLEEP
else:
    dist.barrier()   # BARRIER
