"""Subgroups created in a different order on one rank: the same group name has different members."""

from distcheck import scenario


@scenario(expect="hang")
def subgroups_created_in_different_order(ctx):
    """The last rank builds its groups in another order (a code path of its own, e.g. the evaluation rank):
    its first new_group asks for every rank while the others' asks for ranks 0 and 1."""
    import torch
    import torch.distributed as dist

    from _catalogue import pair_and_world

    _, world = pair_and_world(ctx, dist, pair_first=ctx.rank != ctx.world_size - 1)
    dist.all_reduce(torch.ones(1, device=ctx.device), group=world)
