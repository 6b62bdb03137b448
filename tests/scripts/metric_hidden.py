"""A metric class from a module loaded by path under a name nothing can import (not in sys.modules),
at the top level of a script without a main guard."""

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

spec = importlib.util.spec_from_file_location("not_importable_metrics", Path(__file__).parent / "metric_lib" /
                                              "hidden_count.py")
hidden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hidden)

dist.init_process_group("gloo")
m = hidden.HiddenCount()
for _ in range(3):
    m.update(torch.ones(dist.get_rank() + 1))
print("value", m.compute())
dist.destroy_process_group()
