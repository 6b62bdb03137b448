"""Gradient accumulation done on one rank only: rank 0 skips DDP's gradient sync (no_sync()) on the
first step, the others do not. Its later all_reduces pair with the others' earlier ones (a silent
crossing), and the others' last all_reduce waits for a call rank 0 never makes."""

from distcheck import scenario

STEPS = 3


@scenario(expect="hang")
def ddp_no_sync_one_rank(ctx):
    """Rank 0 runs step 1 under model.no_sync(); the others sync every step: they hang in the last backward()."""
    from _catalogue import accumulate_steps, ddp_model

    accumulate_steps(ctx, ddp_model(ctx), STEPS, lambda step: ctx.rank == 0 and step == 0)   # the bug
