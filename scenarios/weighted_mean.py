"""The fix of mean_of_means: sum (correct, count) across ranks, then divide once."""

from _catalogue import global_accuracy, rank_predictions

from distcheck import scenario


@scenario(expect="pass")
def weighted_mean(ctx):
    """all_reduce(SUM) of (correct, count) and one division: equals the accuracy over all samples."""
    import torch
    import torch.distributed as dist

    preds, target = rank_predictions(ctx, ctx.rank)
    counts = torch.tensor([float((preds == target).sum()), float(target.numel())], device=ctx.device)
    dist.all_reduce(counts)
    ctx.check_close("accuracy", (counts[0] / counts[1]).cpu(), global_accuracy(ctx))
