"""The fix for dtensor_full_tensor_one_rank: every rank of the mesh calls full_tensor()."""

from distcheck import scenario


@scenario(expect="pass", backends=("gloo",))
def dtensor_full_tensor_all_ranks(ctx):
    """Every rank calls full_tensor() on the sharded DTensor, then all_gathers its metrics."""
    from _catalogue import dtensor_then_metrics

    dtensor_then_metrics(ctx, gathers=True)
