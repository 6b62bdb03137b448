"""Rank 0 computes for longer than the stall timeout (a rank-0-only evaluation, a checkpoint save),
then joins the barrier the others already wait in. Late is not hung: this must pass, with a
straggler warning that says who waited how long for whom."""

from distcheck import scenario

BUSY_S = 12.0    # above the default --stall-timeout (10 s); --option busy_s=N changes it


@scenario(expect="straggler")
def rank0_slow_then_barrier(ctx):
    """Rank 0 is busy in Python for 12 s before dist.barrier(); the others wait in it."""
    import time

    import torch.distributed as dist

    if ctx.rank == 0:
        deadline = time.monotonic() + float(ctx.options.get("busy_s", BUSY_S))
        n = 0
        while time.monotonic() < deadline:   # real work, not a sleep: the CPU is busy
            n = (n * 31 + 7) % 1_000_003
    dist.barrier()
