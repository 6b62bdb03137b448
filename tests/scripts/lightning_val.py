"""A plain Lightning DDP validation script, as users write them (run under distcheck in the tests).

--rank0-log: the bug — self.log(..., sync_dist=True) only inside `if self.global_rank == 0:`.
--rank0-log-dict: the same bug through self.log_dict({...}, sync_dist=True).
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.tensor([float(i)])
        return x, (x ** 2)


class Model(L.LightningModule):
    def __init__(self, rank0_log: bool, rank0_log_dict: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.rank0_log = rank0_log
        self.rank0_log_dict = rank0_log_dict

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("val_loss", loss, sync_dist=True)
        if self.rank0_log and self.global_rank == 0:
            self.log("rank0_loss", loss, sync_dist=True)   # the bug: a collective on rank 0 only
        if self.rank0_log_dict and self.global_rank == 0:
            self.log_dict({"rank0_a": loss, "rank0_b": loss * 2}, sync_dist=True)   # the same bug, via log_dict
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--rank0-log", action="store_true")
    p.add_argument("--rank0-log-dict", action="store_true")
    args = p.parse_args()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(Squares(args.samples), batch_size=2)
    trainer.validate(Model(args.rank0_log, args.rank0_log_dict), dataloaders=loader, verbose=False)


if __name__ == "__main__":
    main()
