"""The fix for functional_collective_subset: every rank calls the functional collective."""

from distcheck import scenario


@scenario(expect="pass")
def functional_collective_all_ranks(ctx):
    """Every rank calls funcol.all_reduce and uses its result."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    t = torch.ones(4, device=ctx.device)
    total = funcol.all_reduce(t, "sum", dist.group.WORLD)
    ctx.check_close("all_reduce of ones", total, torch.full((4,), float(ctx.world_size), device=ctx.device))
