"""broadcast_object_list where the sender has 2 objects and the receivers expect 1."""

import torch.distributed as dist

dist.init_process_group("gloo")
objects = ["config", {"lr": 0.1}] if dist.get_rank() == 0 else [None]
dist.broadcast_object_list(objects, src=0)  # OBJECTS
