"""The fix for fsdp2_extra_step: every rank trains the same number of steps."""

from distcheck import scenario

STEPS = 2


@scenario(expect="pass", requires=("torch:fully_shard",))
def fsdp2_same_steps(ctx):
    """Every rank trains 2 steps of a fully_shard model."""
    from _catalogue import fsdp2_steps

    fsdp2_steps(ctx, STEPS)
