"""The smallest hang inside a collective issued from C++, for benchmarks/detection_latency.py
(--hang cpp): DDP with uneven inputs, rank 0's gradient all_reduce comes from DDP's reducer."""

from distcheck import scenario


@scenario(expect="hang")
def ddp_rank0_extra_step(ctx):
    """Every rank trains 2 DDP steps; rank 0 alone runs a 3rd backward()."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 1))
    for _ in range(3 if ctx.rank == 0 else 2):
        model(torch.randn(8, 4)).sum().backward()
