"""DTensor's full_tensor() on one rank only: its all_gather, issued from C++, meets the others' metric
all_gather of another size, and gloo aborts the gathering rank."""

from distcheck import scenario


@scenario(expect="mismatch", backends=("gloo",))
def dtensor_full_tensor_one_rank(ctx):
    """Only the last rank calls full_tensor() on a sharded DTensor; the others go on to all_gather their metrics."""
    from _catalogue import dtensor_then_metrics

    dtensor_then_metrics(ctx, gathers=ctx.rank == ctx.world_size - 1)   # the bug
