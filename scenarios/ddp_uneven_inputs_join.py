"""The fix for ddp_uneven_inputs: torch.distributed.algorithms.Join shadows the missing all_reduces
of the ranks that run out of data first."""

from distcheck import scenario

STEPS = 3


@scenario(expect="pass")
def ddp_uneven_inputs_join(ctx):
    """Rank 0 trains 3 steps, the others 2, inside Join([model]): every rank finishes."""
    from torch.distributed.algorithms import Join

    from _catalogue import ddp_model, train_steps

    model = ddp_model(ctx)
    with Join([model]):
        train_steps(ctx, model, STEPS if ctx.rank == 0 else STEPS - 1)
