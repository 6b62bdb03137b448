"""A 3-stage torch.distributed.pipelining job on gloo whose middle stage splits the batch differently.

Each rank computes n_microbatches from its own memory budget; the middle stage reads a smaller one and
runs 4 microbatches where its neighbours run 2. ScheduleGPipe then waits forever: the middle stage for
a third forward microbatch that stage 0 never sends, stage 0 for the middle stage's backward.
(pipeline_gpipe.py is its healthy twin.)
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

BATCH, WIDTH, STEPS = 8, 16, 3


def n_microbatches(budget_rows: int) -> int:
    return max(1, BATCH // budget_rows)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
budget_rows = 2 if rank == 1 else 4   # the middle stage reads a memory budget of its own
torch.manual_seed(rank)
stage = PipelineStage(torch.nn.Linear(WIDTH, WIDTH), rank, world, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches(budget_rows), loss_fn=lambda out, y: ((out - y) ** 2).mean())
optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
for step in range(STEPS):
    optimizer.zero_grad()
    if rank == 0:
        schedule.step(x)  # FIRST-STAGE
    elif rank == world - 1:
        losses = []
        schedule.step(target=y, losses=losses)  # LAST-STAGE
    else:
        schedule.step()  # MIDDLE-STAGE
    optimizer.step()
dist.barrier()
print(f"rank {rank} done")
dist.destroy_process_group()
