"""A plain Lightning DDP fit on CPU (gloo): 2 epochs of 4 batches, a synced metric in validation."""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
