"""MoE token routing with all_to_all_single: each rank computes the receive sizes from its own token count."""

from distcheck import scenario

HIDDEN = 64
TOKENS_PER_PEER = 2     # tokens every rank routes to each expert rank
BUSY_RANK_TOKENS = 5    # the last rank's batch is bigger: it routes this many to each peer


def _routed(ctx):
    """(tokens, input_split_sizes): how many rows of the hidden states this rank sends to each rank."""
    import torch

    per_peer = BUSY_RANK_TOKENS if ctx.rank == ctx.world_size - 1 else TOKENS_PER_PEER
    splits = [per_peer] * ctx.world_size
    tokens = torch.full((sum(splits), HIDDEN), float(ctx.rank), device=ctx.device)
    return tokens, splits


@scenario(expect="mismatch")
def moe_all_to_all_splits(ctx):
    """The receive sizes are assumed to equal this rank's own send sizes (capacity from the local token count):
    the last rank sends 5 rows (320 elements) to each peer, which expects 2 rows (128 elements)."""
    import torch
    import torch.distributed as dist

    tokens, in_splits = _routed(ctx)
    out_splits = list(in_splits)       # wrong: what each peer sends is only known to that peer
    out = torch.empty((sum(out_splits), HIDDEN), device=ctx.device)
    dist.all_to_all_single(out, tokens, output_split_sizes=out_splits, input_split_sizes=in_splits)


@scenario(expect="pass")
def moe_all_to_all_splits_exchanged(ctx):
    """The fix: exchange the split sizes first (one all_to_all_single of counts), then route the tokens."""
    import torch
    import torch.distributed as dist

    tokens, in_splits = _routed(ctx)
    counts = torch.tensor(in_splits, dtype=torch.int64, device=ctx.device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    out_splits = received.tolist()
    out = torch.empty((sum(out_splits), HIDDEN), device=ctx.device)
    dist.all_to_all_single(out, tokens, output_split_sizes=out_splits, input_split_sizes=in_splits)
    ctx.require("tokens routed", out.shape[0] == sum(out_splits), "every token reached its expert rank")
