"""A torch.distributed.pipelining schedule that can never finish: a middle stage reads a smaller memory
budget of its own and splits the batch into 4 microbatches where its neighbours use 2. Under ScheduleGPipe it
waits for a third forward microbatch that stage 0 never sends, while stage 0 waits for its backward. The
stages wait on each other's P2P handles: a certain hang, named at each rank's schedule.step line."""

from distcheck import scenario


@scenario(expect="hang", min_world_size=3)
def pipeline_stage_splits_differently(ctx):
    """Rank 1 (a middle stage) runs 4 microbatches of 2 rows; every other stage 2 of 4 (needs 3 ranks)."""
    from _catalogue import PIPELINE_BUDGET_ROWS, pipeline_steps

    pipeline_steps(ctx, 2 if ctx.rank == 1 else PIPELINE_BUDGET_ROWS)   # the bug
