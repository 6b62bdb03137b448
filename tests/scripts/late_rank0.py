"""Rank 0 computes (a rank-0-only evaluation) for --busy-s seconds, then joins the barrier the
others already wait in: late, not hung."""

import argparse
import time

import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--busy-s", type=float, default=15.0)
args = p.parse_args()
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    deadline, n = time.monotonic() + args.busy_s, 0
    while time.monotonic() < deadline: n = (n * 31 + 7) % 1_000_003  # BUSY (one line: a sample lands on it)
dist.barrier()
