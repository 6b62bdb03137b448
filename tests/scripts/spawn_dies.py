"""mp.spawn ranks where rank 1 dies by a signal after the first all_reduce (--signal KILL|SEGV);
rank 0 waits in the second. No Python exception anywhere: only the signal."""

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, world: int, sig: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))  # DIES
    dist.all_reduce(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", default="29512")
    p.add_argument("--signal", default="KILL")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    mp.spawn(work, args=(2, args.signal), nprocs=2)


if __name__ == "__main__":
    main()
