"""Rank 0 collects each worker's result with a receive from any source; one worker's result is bigger."""

from distcheck import scenario

SLOTS = 1           # the result size rank 0 allocates for every worker
BIG_RESULT = 97     # the last worker found this many entries


def _result(ctx):
    import torch

    n = BIG_RESULT if ctx.rank == ctx.world_size - 1 else SLOTS
    return torch.full((n,), float(ctx.rank), device=ctx.device)


@scenario(expect="mismatch")
def recv_any_source_sizes(ctx):
    """dist.recv without src takes whichever worker is ready, into a buffer sized for one entry: the last
    worker sends 97 floats (388 bytes) where 4 bytes are expected, and gloo aborts rank 0. No pair of
    records names the sender, so gloo's message is the evidence."""
    import torch
    import torch.distributed as dist

    if ctx.rank != 0:
        dist.send(_result(ctx), dst=0)
        return
    for _ in range(ctx.world_size - 1):
        buf = torch.empty(SLOTS, device=ctx.device)
        dist.recv(buf)


@scenario(expect="pass")
def recv_sized_per_worker(ctx):
    """The fix: each worker sends its result's length first, and rank 0 receives from each worker by name."""
    import torch
    import torch.distributed as dist

    if ctx.rank != 0:
        result = _result(ctx)
        dist.send(torch.tensor([result.numel()], device=ctx.device), dst=0)
        dist.send(result, dst=0)
        return
    for worker in range(1, ctx.world_size):
        n = torch.empty(1, dtype=torch.int64, device=ctx.device)
        dist.recv(n, src=worker)
        buf = torch.empty(int(n.item()), device=ctx.device)
        dist.recv(buf, src=worker)
