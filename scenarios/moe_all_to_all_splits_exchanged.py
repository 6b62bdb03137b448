"""The fix for moe_all_to_all_splits: exchange the split sizes before routing the tokens."""

from distcheck import scenario


@scenario(expect="pass")
def moe_all_to_all_splits_exchanged(ctx):
    """The fix: exchange the split sizes first (one all_to_all_single of counts), then route the tokens."""
    import torch
    import torch.distributed as dist

    from _catalogue import MOE_HIDDEN, moe_routed

    tokens, in_splits = moe_routed(ctx)
    counts = torch.tensor(in_splits, dtype=torch.int64, device=ctx.device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    out_splits = received.tolist()
    out = torch.empty((sum(out_splits), MOE_HIDDEN), device=ctx.device)
    dist.all_to_all_single(out, tokens, output_split_sizes=out_splits, input_split_sizes=in_splits)
    ctx.require("tokens routed", out.shape[0] == sum(out_splits), "every token reached its expert rank")
