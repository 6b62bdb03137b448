"""A DDP test harness in torchmetrics' style (its unittests/conftest.py): one pool of 2 worker
processes for the whole session; every test re-initializes the process group in both workers, with
the rank the task gives, so a worker may come back under another rank. As torchmetrics does, each
setup moves to the next port: the worker that was rank 0 may destroy its old store's server only
after the new rank 0 binds."""

import os
import socket

import pytest
import torch
from torch.multiprocessing import get_context

NUM_PROCESSES = 2
_setups = 0   # per worker: both workers run one setup per test, so they agree on the port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_ddp(rank: int, world_size: int) -> None:
    global _setups
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(int(os.environ["POOL_SUITE_PORT"]) + _setups)
    _setups += 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def pytest_sessionstart(session):
    os.environ["POOL_SUITE_PORT"] = str(_free_port())   # the workers inherit it
    pytest.pool = get_context("spawn").Pool(processes=NUM_PROCESSES)


def pytest_sessionfinish(session, exitstatus):
    pytest.pool.close()
    pytest.pool.join()
