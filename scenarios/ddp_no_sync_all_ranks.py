"""The fix for ddp_no_sync_one_rank: every rank accumulates on the same steps."""

from distcheck import scenario

STEPS = 3


@scenario(expect="pass")
def ddp_no_sync_all_ranks(ctx):
    """Every rank runs step 1 under model.no_sync() and syncs on the others: all finish."""
    import contextlib

    import torch

    from _catalogue import ddp_model

    model = ddp_model(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(8, 4, generator=ctx.generator).to(ctx.device)
        skip = step == 0
        with model.no_sync() if skip else contextlib.nullcontext():
            loss = model(x).sum()
            loss.backward()
        if not skip:
            opt.step()
            opt.zero_grad()
