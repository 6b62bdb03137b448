"""A certain hang on a dead peer, for benchmarks/detection_latency.py (--hang dead): rank 0 waits in an
all_reduce; the last rank dies (os._exit) instead of joining it."""

from distcheck import scenario


@scenario(expect="crash")
def last_rank_dies(ctx):
    """Every rank does one all_reduce; then rank 0 enters a second one and the last rank dies."""
    import os

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == ctx.world_size - 1:
        os._exit(3)
    if ctx.rank == 0:
        dist.all_reduce(t)
