"""Lightning DDP under Slurm, as cluster users run it (``srun -n 2 python lit_stuck.py``): Lightning picks
``SLURMEnvironment`` from srun's variables and, after init_process_group, installs its auto-requeue
handler on SIGUSR1. Rank 0 alone calls a barrier in its first training step: the others go on to the
next step's gradient all_reduce. Nothing distcheck does may fire the requeue handler (rule 0)."""

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 and self.global_rank == 0:
            dist.barrier()  # STUCK
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    data = TensorDataset(torch.arange(64.0).unsqueeze(1), torch.arange(64.0).unsqueeze(1))
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=".",
                        plugins=[SLURMEnvironment(auto_requeue=True)])
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    trainer.fit(Model(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
