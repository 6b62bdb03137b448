"""DTensor's full_tensor() on rank 0 only, while its peers' FSDP2 pre-forward all-gathers the next step's
first layer: both all_gathers are issued from C++, they meet at one number of the group with different
sizes, and gloo aborts a rank — often before rank 0's record has the call it died in."""

from distcheck import scenario


@scenario(expect="mismatch", backends=("gloo",), requires=("torch:fully_shard",))
def fsdp2_peers_full_tensor_one_rank(ctx):
    """Rank 0 exports a weight of an FSDP2 model with full_tensor() between two steps; the others go on training."""
    from _catalogue import fsdp2_export_between_steps

    fsdp2_export_between_steps(ctx, exports=ctx.rank == 0)   # the bug: export on every rank, or gather elsewhere
