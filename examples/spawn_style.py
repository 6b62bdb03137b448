"""A job that starts its own ranks with torch.multiprocessing.spawn: run it as a command.

    distcheck run -- python spawn_style.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def work(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    print(f"rank {rank}: sum {t[0].item():g}", flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(work, args=(int(os.environ.get("PORT") or free_port()),), nprocs=WORLD)
