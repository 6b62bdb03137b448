"""Gradient accumulation done on one rank only: rank 0 skips DDP's gradient sync (no_sync()) on the
first step, the others do not. Its later all_reduces pair with the others' earlier ones (a silent
crossing), and the others' last all_reduce waits for a call rank 0 never makes."""

from distcheck import scenario

STEPS = 3


@scenario(expect="hang")
def ddp_no_sync_one_rank(ctx):
    """Rank 0 runs step 1 under model.no_sync(); the others sync every step: they hang in the last backward()."""
    import contextlib

    import torch

    from _catalogue import ddp_model

    model = ddp_model(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(8, 4, generator=ctx.generator).to(ctx.device)
        skip = ctx.rank == 0 and step == 0     # the bug: accumulation decided per rank
        with model.no_sync() if skip else contextlib.nullcontext():
            loss = model(x).sum()
            loss.backward()
        if not skip:
            opt.step()
            opt.zero_grad()
