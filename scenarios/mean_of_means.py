"""Accuracy averaged across ranks as a mean of per-rank means, with unequal sample counts per rank."""

from _catalogue import global_accuracy, rank_predictions

from distcheck import scenario


@scenario(expect="numeric")
def mean_of_means(ctx):
    """Each rank computes its local accuracy, then all_reduce(SUM) / world_size: a rank with 2 samples weighs as
    much as a rank with 6, so the result is not the accuracy over all samples."""
    import torch.distributed as dist

    preds, target = rank_predictions(ctx, ctx.rank)
    acc = (preds == target).float().mean().reshape(1).to(ctx.device)
    dist.all_reduce(acc)
    acc /= ctx.world_size
    ctx.check_close("accuracy", acc.cpu().squeeze(), global_accuracy(ctx),
                    note="A mean of per-rank means weighs every rank equally; all_reduce the counts, then divide.")
