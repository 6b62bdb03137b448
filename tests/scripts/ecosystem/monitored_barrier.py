"""torch's monitored_barrier on gloo, then an all_reduce on every rank.

--late R: rank R arrives 8 s late (healthy: the job completes).
--skip R: rank R never calls monitored_barrier (a hang: it goes straight to the all_reduce).
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--late", type=int, default=-1)
parser.add_argument("--late-s", type=float, default=8.0)
parser.add_argument("--skip", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == args.late:
    time.sleep(args.late_s)   # busy elsewhere: late, not hung
if rank != args.skip:
    dist.monitored_barrier(timeout=timedelta(seconds=60))  # MONITORED
dist.all_reduce(t)  # AFTER
# Different calls after it: numbered by the group's raw counter, rank 0's would meet its peers' other calls.
dist.broadcast(torch.zeros(3), src=0)
dist.all_reduce(torch.ones(7))
dist.barrier()
print(f"rank {rank} done", t.tolist())
dist.destroy_process_group()
