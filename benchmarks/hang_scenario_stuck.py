"""An uncertain hang, for benchmarks/detection_latency.py (--hang stuck): rank 0 blocks on an Event that is
never set while the others wait in a barrier. Nothing tells that rank 0 will never come but its silence:
no CPU, no I/O, no stack change for --stall-timeout."""

from distcheck import scenario


@scenario(expect="hang")
def rank0_blocked_on_event(ctx):
    """Rank 0 waits on an Event nobody sets; the others enter the barrier."""
    import threading

    import torch.distributed as dist

    if ctx.rank == 0:
        threading.Event().wait()
    dist.barrier()
