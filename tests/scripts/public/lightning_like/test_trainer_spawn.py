"""Lightning's Trainer on two CPU ranks that the pytest process spawns (``strategy="ddp_spawn"``)."""

import torch
import torch.distributed as dist

from _trainers import SyncedLossModel, flat_weights, quiet_trainer


def test_fit_on_two_spawned_ranks(tmp_path):
    model = SyncedLossModel()
    before = flat_weights(model)
    trainer = quiet_trainer(tmp_path, "ddp_spawn")
    trainer.fit(model)
    assert trainer.state.finished
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert not torch.equal(flat_weights(model), before)   # rank 0's trained weights came back
    assert not dist.is_initialized()   # the ranks were the spawned processes, not this one

