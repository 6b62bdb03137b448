"""A small distributed test suite: each test starts 2 ranks of its own (mp.spawn), as PyTorch's own tests do.

    distcheck run --stall-timeout 10 --junit-xml junit.xml -- python -m pytest tests/dist/
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0, 2.0]
    dist.destroy_process_group()


def _broadcast(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=1)
    assert t.item() == 1.0
    dist.destroy_process_group()


def test_all_reduce():
    mp.spawn(_all_reduce, args=(_port(),), nprocs=2)


def test_broadcast():
    mp.spawn(_broadcast, args=(_port(),), nprocs=2)
