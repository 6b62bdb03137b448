"""The fix for ddp_no_sync_one_rank: every rank accumulates on the same steps."""

from distcheck import scenario

STEPS = 3


@scenario(expect="pass")
def ddp_no_sync_all_ranks(ctx):
    """Every rank runs step 1 under model.no_sync() and syncs on the others: all finish."""
    from _catalogue import accumulate_steps, ddp_model

    accumulate_steps(ctx, ddp_model(ctx), STEPS, lambda step: step == 0)
