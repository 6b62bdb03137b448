"""An accelerate script whose ``finally:`` ends training (destroying the process group), then raises
KeyError on every rank. --no-raise: the healthy twin."""

import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(4, 2))
config: dict[str, int] = {}
try:
    for _ in range(3):
        loss = model(torch.ones(2, 4)).sum()
        accelerator.backward(loss)
    accelerator.wait_for_everyone()
finally:
    accelerator.end_training()
if "--no-raise" not in sys.argv:
    print(config["learning_rate"])  # RAISES
