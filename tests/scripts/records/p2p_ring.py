"""A ring exchange with batch_isend_irecv (each rank sends to the next, receives from the previous),
three rounds, then an all_reduce. Healthy."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
buf = torch.zeros(4)
for round_ in range(3):
    send = torch.full((4,), float(rank + round_))
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, buf, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
total = buf.clone()
dist.all_reduce(total)
dist.destroy_process_group()
