"""A functional collective (the API DTensor, FSDP2 and compiled graphs use) issued on a subset of
ranks: it never goes through torch.distributed's Python functions."""

from distcheck import scenario


@scenario(expect="hang")
def functional_collective_subset(ctx):
    """Only rank 0 calls funcol.all_reduce and waits on its result; the others never join."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    t = torch.ones(4, device=ctx.device)
    if ctx.rank == 0:
        total = funcol.all_reduce(t, "sum", dist.group.WORLD)
        print(total.sum().item())    # using the result waits for the collective
