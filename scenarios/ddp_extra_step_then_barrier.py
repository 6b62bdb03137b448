"""DDP with uneven inputs, then a barrier: rank 0's extra gradient all_reduce (issued from C++)
meets the other ranks' barrier at the same number. Every rank waits, each in a different call: the
mismatch is the cause, and no second finding may put rank 0 in the others' barrier.

Only the Flight Recorder says what rank 0's C++-issued call was: without one (gloo before torch 2.8)
the records show a call of unknown op against the barrier, and the mismatch cannot be told.

At 2 ranks there is no odd one out: rank 0 waits in its all_reduce, rank 1 in its barrier, each in its
own call, and the verdict is the certain hang that names both calls (expected there)."""

from distcheck import scenario

STEPS = 2


@scenario(expect="mismatch", expect_by_world_size={2: "hang"}, requires=("torch:flight_recorder",))
def ddp_extra_step_then_barrier(ctx):
    """Rank 0 trains 3 DDP steps, the others 2; then every rank calls dist.barrier()."""
    import torch.distributed as dist

    from _catalogue import ddp_model, train_steps

    model = ddp_model(ctx)
    train_steps(ctx, model, STEPS + 1 if ctx.rank == 0 else STEPS)
    dist.barrier()
