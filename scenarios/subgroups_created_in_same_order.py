"""The fix for subgroups_created_in_different_order: every rank creates the same groups in the same order."""

from distcheck import scenario


@scenario(expect="pass")
def subgroups_created_in_same_order(ctx):
    """The fix: every rank creates the same groups in the same order, whether it is a member or not."""
    import torch
    import torch.distributed as dist

    from _catalogue import pair_and_world

    _, world = pair_and_world(ctx, dist, pair_first=True)
    dist.all_reduce(torch.ones(1, device=ctx.device), group=world)
