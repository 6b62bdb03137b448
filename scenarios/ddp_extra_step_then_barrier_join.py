"""The fix for ddp_extra_step_then_barrier: Join shadows the missing gradient all_reduces, so
the barrier after the loop pairs with the barrier on every rank."""

from distcheck import scenario

STEPS = 2


@scenario(expect="pass")
def ddp_extra_step_then_barrier_join(ctx):
    """Rank 0 trains 3 DDP steps, the others 2, inside Join([model]); then every rank calls dist.barrier()."""
    import torch.distributed as dist
    from torch.distributed.algorithms import Join

    from _catalogue import ddp_model, train_steps

    model = ddp_model(ctx)
    with Join([model]):
        train_steps(ctx, model, STEPS + 1 if ctx.rank == 0 else STEPS)
    dist.barrier()
