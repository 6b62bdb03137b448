"""A certain hang by a cycle, for benchmarks/detection_latency.py (--hang cycle): every rank sends to
its right neighbour before receiving from its left one (gloo's send waits for the matching recv)."""

from distcheck import scenario


@scenario(expect="hang")
def send_ring_before_recv(ctx):
    """Each rank sends to (rank + 1) % world, then receives from (rank - 1) % world."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    dist.send(t, (ctx.rank + 1) % ctx.world_size)
    dist.recv(t, (ctx.rank - 1) % ctx.world_size)
