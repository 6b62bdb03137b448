"""Rank 0 collects each worker's result with a receive from any source; one worker's result is bigger."""

from distcheck import scenario


@scenario(expect="mismatch")
def recv_any_source_sizes(ctx):
    """dist.recv without src takes whichever worker is ready, into a buffer sized for one entry: the last
    worker sends 97 floats (388 bytes) where 4 bytes are expected, and gloo aborts rank 0. No pair of
    records names the sender, so gloo's message is the evidence."""
    import torch
    import torch.distributed as dist

    from _catalogue import WORKER_RESULT_SLOTS, worker_result

    if ctx.rank != 0:
        dist.send(worker_result(ctx), dst=0)
        return
    for _ in range(ctx.world_size - 1):
        buf = torch.empty(WORKER_RESULT_SLOTS, device=ctx.device)
        dist.recv(buf)
