"""SUM on some ranks, MAX on others: the collective completes on every backend and the numbers are wrong."""

from distcheck import scenario

STEPS = 3


def _local_loss(ctx, step):
    import torch

    return torch.tensor([float(ctx.rank + step)], device=ctx.device)


@scenario(expect="mismatch")
def reduce_op_mismatch(ctx):
    """The last rank reduces its loss with MAX, every other rank with SUM (a per-rank config flag)."""
    import torch.distributed as dist

    # Stands for a flag read from a per-host config file: one host has an old copy.
    use_max = ctx.rank == ctx.world_size - 1
    for step in range(STEPS):
        loss = _local_loss(ctx, step)
        if use_max:
            dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
