"""Issue 13's first report: an unsharded eval loader (use_distributed_sampler=False) cut by limit_val_batches=2."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(100, 4, generator=g), torch.randn(100, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="ddp", use_distributed_sampler=False,
                        limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.validate(Model(), dataloaders=DataLoader(data, batch_size=3), verbose=False)


if __name__ == "__main__":
    main()
