"""FSDP2 (fully_shard) with one extra training step on rank 0: its parameter all_gather in forward
waits for ranks that already stopped."""

from distcheck import scenario

STEPS = 2


@scenario(expect="hang", requires=("torch:fully_shard",))
def fsdp2_extra_step(ctx):
    """Rank 0 trains 3 steps of a fully_shard model, the others 2: rank 0 hangs in FSDP's all_gather."""
    from _catalogue import fsdp2_steps

    fsdp2_steps(ctx, STEPS + 1 if ctx.rank == 0 else STEPS)
