"""DDP with uneven inputs: rank 0 has one more batch, so its gradient all_reduce (issued by DDP's C++
reducer during loss.backward()) waits for ranks that already left the loop."""

from distcheck import scenario

STEPS = 3


@scenario(expect="hang")
def ddp_uneven_inputs(ctx):
    """Rank 0 trains 3 steps, the others 2: rank 0 hangs in DDP's gradient all_reduce of its 3rd backward()."""
    from _catalogue import ddp_model, train_steps

    model = ddp_model(ctx)
    train_steps(ctx, model, STEPS if ctx.rank == 0 else STEPS - 1)
