"""PyTorch's DDP-tutorial style: the script starts its own ranks with torch.multiprocessing.spawn.

--bug: only rank 0 calls dist.barrier() (rank 1 never comes).
--hold: every rank sleeps in its collective-free loop forever (for teardown tests).
--exit N: after the ranks finished, the script itself exits with code N (a failing step after training).
"""

import argparse
import os
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, world: int, bug: bool, hold: bool) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    print(f"rank {rank} up", flush=True)
    while hold:
        time.sleep(0.1)
    if rank == 0 or not bug:
        dist.barrier()   # the barrier
    # torch itself aborts now and then at the exit of a process whose gloo group was never destroyed
    # ("terminate called without an active exception": 1 of 8 plain torchrun runs of such a script): the
    # tests that run this script judge distcheck, not that. With --bug, rank 1 keeps its group as the
    # tutorial does: destroying it would fail rank 0's barrier at once, before its stack could be read.
    if not bug:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", default="29511")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bug", action="store_true")
    p.add_argument("--hold", action="store_true")
    p.add_argument("--exit", type=int, default=0)
    args = p.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    mp.spawn(work, args=(args.world, args.bug, args.hold), nprocs=args.world)
    raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
