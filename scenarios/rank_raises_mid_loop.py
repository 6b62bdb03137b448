"""One rank raises in the middle of the loop; the others wait in their next collective."""

from distcheck import scenario

STEPS = 6
FAIL_AT = 3


@scenario(expect="crash")
def rank_raises_mid_loop(ctx):
    """The last rank raises ValueError at step 3 (a corrupt sample); the others block in all_reduce #4."""
    import torch
    import torch.distributed as dist

    for step in range(STEPS):
        if ctx.rank == ctx.world_size - 1 and step == FAIL_AT:
            raise ValueError(f"corrupt sample in batch {step}")
        t = torch.ones(2, device=ctx.device)
        dist.all_reduce(t)
