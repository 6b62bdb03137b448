"""Standalone tests: the pytest process is rank 0, and Lightning's launcher starts rank 1 as the same pytest
command again (``LOCAL_RANK=1``). Each runs alone in its pytest process (conftest.py)."""

import pytest
import torch
from lightning.fabric import Fabric

from _trainers import SyncedLossModel, flat_weights, quiet_trainer

pytestmark = pytest.mark.standalone


def test_trainer_ddp_with_pytest_as_rank_zero(tmp_path):
    model = SyncedLossModel()
    trainer = quiet_trainer(tmp_path, "ddp")
    trainer.fit(model)
    assert trainer.world_size == 2 and trainer.global_step == 2
    gathered = trainer.strategy.all_gather(flat_weights(model))
    assert torch.equal(gathered[0], gathered[1])   # DDP kept the replicas equal
    trainer.strategy.barrier("end of test")


def test_fabric_ddp_with_pytest_as_rank_zero():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(7)
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        loss = model(torch.randn(8, 4) + fabric.global_rank).sum()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum").item() == 3.0
    gathered = fabric.all_gather(flat_weights(model))
    assert torch.equal(gathered[0], gathered[1])
    assert fabric.broadcast(fabric.global_rank) == 0
    fabric.barrier()
