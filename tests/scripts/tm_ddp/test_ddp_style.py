"""DDP tests in torchmetrics' style: every task runs in both pool workers (pool.map over ranks).

PLANT_WRONG_REDUCE=1 plants a wrong dist_reduce_fx ("max" for a count) in one metric:
distcheck must call that an error while the test itself still passes.
"""

import os
from functools import partial

import pytest
import torch
from conftest import NUM_PROCESSES, free_port, setup_ddp
from torch import tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.aggregation import CatMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError
from torchmetrics.wrappers import ClasswiseWrapper, MultitaskWrapper, Running

WRONG = os.environ.get("PLANT_WRONG_REDUCE") == "1"


class DummyCount(Metric):
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("n", default=tensor(0), dist_reduce_fx="max" if WRONG else "sum")

    def update(self, x):
        self.n += x.numel()

    def compute(self):
        return self.n


def _sum(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    m = SumMetric()
    m.update(tensor(rank + 1.0))
    assert m.compute() == 3


def _count(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    m = DummyCount()
    for _ in range(3):
        m.update(torch.ones(rank + 1))
    value = m.compute()
    assert value == (6 if WRONG else 9)


def _cat(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    m = CatMetric()
    m.update(tensor([float(rank + 1)]))
    assert sorted(m.compute().tolist()) == [1.0, 2.0]


def _compositional(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    dummy = SumMetric()
    m = dummy.clone() + dummy.clone()
    m.update(tensor(1.0))
    assert m.compute() == 2 * NUM_PROCESSES


def _running(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    m = Running(SumMetric(), window=3)
    for _ in range(10):
        m(tensor(1.0))
    assert m.compute() == 6


def _collection_of_running(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    coll = MetricCollection({"sum": Running(SumMetric(), 3), "mean": Running(MeanMetric(), 3)})
    for i in range(6):
        coll(tensor([float(i)]))
    assert coll.compute()["sum"] == 2 * (3 + 4 + 5)


def _sync_on_compute(rank, port, sync):
    setup_ddp(rank, NUM_PROCESSES, port)
    m = SumMetric(sync_on_compute=sync)
    m.update(tensor(rank + 1.0))
    assert m.compute() == (3 if sync else rank + 1)


def _collection(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    g = torch.Generator().manual_seed(rank)
    coll = MetricCollection([MulticlassAccuracy(num_classes=3), MulticlassPrecision(num_classes=3)])
    for _ in range(4):
        coll.update(torch.randint(0, 3, (8,), generator=g), torch.randint(0, 3, (8,), generator=g))
    values = coll.compute()
    assert set(values) == {"MulticlassAccuracy", "MulticlassPrecision"}


def _wrappers(rank, port):
    setup_ddp(rank, NUM_PROCESSES, port)
    g = torch.Generator().manual_seed(10 + rank)
    classwise = ClasswiseWrapper(MulticlassAccuracy(num_classes=3, average=None))
    multitask = MultitaskWrapper({"a": MeanSquaredError(), "b": MeanAbsoluteError()})
    for _ in range(3):
        classwise.update(torch.randint(0, 3, (6,), generator=g), torch.randint(0, 3, (6,), generator=g))
        multitask.update({"a": tensor([1.0]), "b": tensor([float(rank)])}, {"a": tensor([0.0]), "b": tensor([0.0])})
    assert len(classwise.compute()) == 3
    assert multitask.compute()["a"] == 1


def _nested_class(rank, port):
    class LocalTotal(Metric):   # defined inside the task: cannot be pickled by reference
        def __init__(self):
            super().__init__()
            self.add_state("total", default=tensor(0.0), dist_reduce_fx="sum")

        def update(self, x):
            self.total += x.sum()

        def compute(self):
            return self.total

    setup_ddp(rank, NUM_PROCESSES, port)
    m = LocalTotal()
    m.update(tensor([1.0, 2.0]))
    assert m.compute() == 6


def _no_collective(rank):
    # No process group work: the pool may run both tasks in the same worker.
    m = SumMetric()
    m.update(tensor(float(rank)))
    assert m.update_count == 1
    local = SumMetric(sync_on_compute=False)
    local.update(tensor(2.0))
    assert local.compute() == 2


def _run(task):
    pytest.pool.map(partial(task, port=free_port()), range(NUM_PROCESSES))


@pytest.mark.parametrize("task", [_sum, _count, _cat, _compositional, _running, _collection_of_running, _collection,
                                  _wrappers, _nested_class])
def test_ddp(task):
    _run(task)


@pytest.mark.parametrize("sync", [True, False])
def test_sync_on_compute(sync):
    _run(partial(_sync_on_compute, sync=sync))


def test_tasks_without_collectives():
    pytest.pool.map(_no_collective, range(NUM_PROCESSES))
    pytest.pool.map(_no_collective, range(NUM_PROCESSES))


def test_ddp_after_uneven_tasks():
    _run(_sum)
    _run(_count)
