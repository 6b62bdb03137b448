"""torchmetrics' DDP test harness, as its unittests/conftest.py has it: a pool of 2 worker
processes made once per session; each DDP test re-initializes the process group in both
workers, with the rank given by the task, so a worker may come back under another rank."""

import os
import socket

import pytest
import torch
from torch.multiprocessing import get_context

NUM_PROCESSES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_ddp(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def pytest_sessionstart(session):
    pool = get_context("spawn").Pool(processes=NUM_PROCESSES)
    port = free_port()
    pool.starmap(setup_ddp, [(rank, NUM_PROCESSES, port) for rank in range(NUM_PROCESSES)])
    pytest.pool = pool


def pytest_sessionfinish(session, exitstatus):
    pytest.pool.close()
    pytest.pool.join()
