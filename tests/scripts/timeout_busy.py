"""A script cut by --timeout (run under distcheck in the tests).

--busy: after one all_reduce, rank 1 spins in user code forever and the others finish.
--alone: after one all_reduce, rank 0 alone calls a barrier and the others finish.
"""

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--busy", action="store_true")
    p.add_argument("--alone", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    if args.busy and dist.get_rank() == 1:
        x = 0
        while True: x += 1  # BUSY
    if args.alone and dist.get_rank() == 0:
        dist.barrier()  # ALONE


if __name__ == "__main__":
    main()
