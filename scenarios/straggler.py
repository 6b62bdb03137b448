"""One rank is consistently late into every collective (slow data loading on one host)."""

from distcheck import scenario

STEPS = 10         # the rule needs the same rank last in 80% of them: 2 noisy steps are tolerated
DELAY_S = 0.2      # far above scheduling noise, so the straggler is the last one in every time


@scenario(expect="straggler")
def straggler(ctx):
    """The last rank sleeps 0.2 s before each all_reduce; every other rank waits for it each step."""
    import time

    import torch
    import torch.distributed as dist

    for _ in range(STEPS):
        if ctx.rank == ctx.world_size - 1:
            time.sleep(DELAY_S)   # creates the straggler; not a synchronisation
        t = torch.ones(4, device=ctx.device)
        dist.all_reduce(t)
