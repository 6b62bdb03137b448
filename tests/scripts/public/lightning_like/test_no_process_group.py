"""Tests that configure distributed training but start no process group."""

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from _trainers import SyncedLossModel, quiet_trainer


def test_ddp_on_two_cpus_is_configured_without_starting_ranks(tmp_path):
    trainer = quiet_trainer(tmp_path, DDPStrategy(find_unused_parameters=True))
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2
    assert not dist.is_initialized()


def test_fit_on_one_cpu(tmp_path):
    trainer = quiet_trainer(tmp_path, "auto", devices=1)
    trainer.fit(SyncedLossModel())
    assert trainer.global_step == 2
    assert not dist.is_initialized()
