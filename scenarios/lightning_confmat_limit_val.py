"""The second seed, as its user had it, scaled to CPU: "are my confusion-matrix rows wrong under DDP?"

Lightning DDP (find_unused_parameters=True, bf16-mixed, limit_val_batches=10,
reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0) logging a real
MulticlassConfusionMatrix. The sync is right: distcheck's replay agrees. The rows
count only the samples the cut validation pass saw, which the coverage line says.
"""

from distcheck import scenario

VAL_SIZE = 10_000
NUM_CLASSES = 10
BATCH = 12
LIMIT_VAL = 10


def _model(num_classes: int):
    import lightning as L
    import torch
    from torchmetrics.classification import MulticlassConfusionMatrix

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, num_classes)
            self.unused = torch.nn.Linear(8, 1)      # why the user needed find_unused_parameters=True
            self.confmat = MulticlassConfusionMatrix(num_classes=num_classes)
            self.rows = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.confmat.update(self.layer(x).argmax(dim=1), y)

        def on_validation_epoch_end(self):
            matrix = self.confmat.compute()   # synced over the ranks
            self.rows = matrix.sum(dim=1).tolist()
            self.confmat.reset()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


def _data(size: int, seed: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(size, 8, generator=g), torch.randint(0, NUM_CLASSES, (size,), generator=g))


@scenario(expect="pass", requires=("lightning", "torchmetrics"))
def lightning_confmat_limit_val(ctx):
    """Lightning DDP with limit_val_batches=10 and a MulticlassConfusionMatrix: the synced matrix matches a
    single process over the samples the cut validation pass saw (coverage and class counts in the report)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(_data(4 * BATCH * ctx.world_size, ctx.seed), batch_size=BATCH)

        def val_dataloader(self):
            return DataLoader(_data(VAL_SIZE, ctx.seed + 1), batch_size=BATCH)

    trainer = L.Trainer(
        accelerator="cpu", devices=ctx.world_size, strategy=DDPStrategy(find_unused_parameters=True),
        precision="bf16-mixed", max_epochs=1, limit_train_batches=2, limit_val_batches=LIMIT_VAL,
        reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_model(NUM_CLASSES), datamodule=Data())
