"""A LightningModule holding a user metric whose count state is reduced with "max" instead of "sum"
(no main guard: Lightning's own launcher runs this file again for rank 1). Run as a script
(`distcheck run metric_lightning.py --nproc-per-node 2`) or with Lightning's launcher
(`distcheck run -- python metric_lightning.py`)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric


class SeenCount(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="max")   # should be "sum"

    def update(self, x):
        self.n += x.shape[0]

    def compute(self):
        return self.n


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = SeenCount()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen.update(x)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_validation_epoch_end(self):
        print("seen", self.seen.compute())   # 8 synced on 2 ranks, 16 in one process
        self.seen.reset()


data = TensorDataset(torch.arange(16.0).unsqueeze(1), torch.arange(16.0).unsqueeze(1))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.validate(Model(), dataloaders=DataLoader(data, batch_size=2), verbose=False)
