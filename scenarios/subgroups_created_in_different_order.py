"""Subgroups created in a different order on one rank: the same group name has different members."""

from distcheck import scenario


def _pair_and_world(ctx, dist, pair_first: bool):
    """(pair group of ranks 0 and 1, a group of every rank), created in the given order."""
    everyone = list(range(ctx.world_size))
    if pair_first:
        pair = dist.new_group([0, 1])
        world = dist.new_group(everyone)
    else:
        world = dist.new_group(everyone)
        pair = dist.new_group([0, 1])
    return pair, world


@scenario(expect="hang")
def subgroups_created_in_different_order(ctx):
    """The last rank builds its groups in another order (a code path of its own, e.g. the evaluation rank):
    its first new_group asks for every rank while the others' asks for ranks 0 and 1."""
    import torch
    import torch.distributed as dist

    _, world = _pair_and_world(ctx, dist, pair_first=ctx.rank != ctx.world_size - 1)
    dist.all_reduce(torch.ones(1, device=ctx.device), group=world)


@scenario(expect="pass")
def subgroups_created_in_same_order(ctx):
    """The fix: every rank creates the same groups in the same order, whether it is a member or not."""
    import torch
    import torch.distributed as dist

    _, world = _pair_and_world(ctx, dist, pair_first=True)
    dist.all_reduce(torch.ones(1, device=ctx.device), group=world)
