"""What the test modules share: a quiet Trainer and a model whose logged values are synced across ranks."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel


class SyncedLossModel(BoringModel):
    """BoringModel that logs its losses with ``sync_dist=True`` (an all_reduce per logged value)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out


def quiet_trainer(root, strategy, devices: int = 2, **kwargs) -> Trainer:
    """Two training steps and one validation batch, with nothing written outside ``root`` and little printed."""
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=devices, max_steps=2,
                   limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, enable_progress_bar=False,
                   enable_model_summary=False, logger=False, enable_checkpointing=False, **kwargs)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])
