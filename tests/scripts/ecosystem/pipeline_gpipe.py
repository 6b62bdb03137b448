"""A 3-stage torch.distributed.pipelining job on gloo: one PipelineStage per rank, ScheduleGPipe.

Healthy: every stage computes n_microbatches from the same memory budget, and the job completes.
(pipeline_microbatches_mismatch.py is its faulty twin: the middle stage reads a budget of its own.)
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

BATCH, WIDTH, STEPS = 8, 16, 8
BUDGET_ROWS = 4   # the rows of one microbatch that fit in a stage's memory: the same on every rank


def n_microbatches(budget_rows: int) -> int:
    return max(1, BATCH // budget_rows)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
stage = PipelineStage(torch.nn.Linear(WIDTH, WIDTH), rank, world, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches(BUDGET_ROWS), loss_fn=lambda out, y: ((out - y) ** 2).mean())
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
