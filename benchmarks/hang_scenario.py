"""The smallest hang, for benchmarks/detection_latency.py: rank 0 enters an
all_reduce that no other rank ever joins."""

from distcheck import scenario


@scenario(expect="hang")
def rank0_waits_alone(ctx):
    """Every rank does one all_reduce; then rank 0 alone calls a second one."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == 0:
        dist.all_reduce(t)
