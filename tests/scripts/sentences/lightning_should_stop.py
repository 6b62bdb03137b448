"""A Lightning DDP fit where one rank's callback sets should_stop and the other trains on (a real-world shape:
an early-stopping rule decided from one rank's metric)."""
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class StopOnRank0(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0 and batch_idx == 2:
            trainer.should_stop = True   # the bug: decided on one rank only


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StopOnRank0()])
    trainer.fit(Model(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
