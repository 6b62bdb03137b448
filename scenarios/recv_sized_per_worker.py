"""The fix for recv_any_source_sizes: each worker sends its result's length first, received by name."""

from distcheck import scenario


@scenario(expect="pass")
def recv_sized_per_worker(ctx):
    """The fix: each worker sends its result's length first, and rank 0 receives from each worker by name."""
    import torch
    import torch.distributed as dist

    from _catalogue import worker_result

    if ctx.rank != 0:
        result = worker_result(ctx)
        dist.send(torch.tensor([result.numel()], device=ctx.device), dst=0)
        dist.send(result, dst=0)
        return
    for worker in range(1, ctx.world_size):
        n = torch.empty(1, dtype=torch.int64, device=ctx.device)
        dist.recv(n, src=worker)
        buf = torch.empty(int(n.item()), device=ctx.device)
        dist.recv(buf, src=worker)
