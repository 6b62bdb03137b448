"""A 3-stage torch.distributed.pipelining job on gloo: one PipelineStage per rank, ScheduleGPipe.

Healthy as it is: every stage computes n_microbatches from the same memory budget, and the job completes.
``--middle-budget 2``: the middle stage reads a smaller budget of its own and runs 4 microbatches where its
neighbours run 2. ScheduleGPipe then waits forever: the middle stage for a third forward microbatch that
stage 0 never sends, stage 0 for the middle stage's backward.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

BATCH, WIDTH = 8, 16
BUDGET_ROWS = 4   # the rows of one microbatch that fit in a stage's memory

parser = argparse.ArgumentParser()
parser.add_argument("--middle-budget", type=int, default=BUDGET_ROWS)
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()


def n_microbatches(budget_rows: int) -> int:
    return max(1, BATCH // budget_rows)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
budget_rows = args.middle_budget if rank == 1 else BUDGET_ROWS
torch.manual_seed(rank)
stage = PipelineStage(torch.nn.Linear(WIDTH, WIDTH), rank, world, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches(budget_rows), loss_fn=lambda out, y: ((out - y) ** 2).mean())
optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
for step in range(args.steps):
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
