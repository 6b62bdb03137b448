"""MoE token routing with all_to_all_single: each rank computes the receive sizes from its own token count."""

from distcheck import scenario


@scenario(expect="mismatch")
def moe_all_to_all_splits(ctx):
    """The receive sizes are assumed to equal this rank's own send sizes (capacity from the local token count):
    the last rank sends 5 rows (320 elements) to each peer, which expects 2 rows (128 elements)."""
    import torch
    import torch.distributed as dist

    from _catalogue import MOE_HIDDEN, moe_routed

    tokens, in_splits = moe_routed(ctx)
    out_splits = list(in_splits)       # wrong: what each peer sends is only known to that peer
    out = torch.empty((sum(out_splits), MOE_HIDDEN), device=ctx.device)
    dist.all_to_all_single(out, tokens, output_split_sizes=out_splits, input_split_sizes=in_splits)
