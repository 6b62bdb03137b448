"""DDP tests in torchmetrics' style: each task runs in both pool workers (pool.map over ranks).

PLANT_HANG=1 adds a test where only rank 0 calls compute(): its sync waits for a rank that
went back to the pool.
"""

import os

import pytest
import torch
from conftest import NUM_PROCESSES, setup_ddp
from torch import tensor
from torchmetrics.aggregation import CatMetric, MeanMetric, SumMetric


def _sum(rank):
    setup_ddp(rank, NUM_PROCESSES)
    m = SumMetric()
    m.update(tensor(rank + 1.0))
    assert m.compute() == 3


def _cat(rank):
    setup_ddp(rank, NUM_PROCESSES)
    m = CatMetric()
    m.update(tensor([float(rank + 1)]))
    assert sorted(m.compute().tolist()) == [1.0, 2.0]


def _mean(rank):
    setup_ddp(rank, NUM_PROCESSES)
    m = MeanMetric()
    m.update(torch.arange(rank + 1, dtype=torch.float32))
    assert abs(float(m.compute()) - 1 / 3) < 1e-6


def _rank0_compute(rank):
    setup_ddp(rank, NUM_PROCESSES)
    m = SumMetric()
    m.update(tensor(1.0))
    if rank == 0:
        m.compute()   # planted: rank 1 never syncs


def test_sum():
    pytest.pool.map(_sum, range(NUM_PROCESSES))


def test_cat():
    pytest.pool.map(_cat, range(NUM_PROCESSES))


@pytest.mark.skipif(os.environ.get("PLANT_HANG") != "1", reason="the planted hang runs only with PLANT_HANG=1")
def test_rank0_only_compute():
    pytest.pool.map(_rank0_compute, range(NUM_PROCESSES))


def test_mean():
    pytest.pool.map(_mean, range(NUM_PROCESSES))
