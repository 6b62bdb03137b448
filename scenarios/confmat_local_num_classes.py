"""num_classes inferred per rank: confusion matrices of different sizes meet in one all_reduce."""

from distcheck import scenario

SAMPLES = 12


def _labels(ctx):
    import torch

    # Classes 0..2 everywhere; only the last rank's shard happens to hold the rare class 3.
    labels = torch.randint(0, 3, (SAMPLES,), generator=ctx.generator)
    if ctx.rank == ctx.world_size - 1:
        labels[0] = 3
    return labels


@scenario(expect="mismatch", requires=("torchmetrics",))
def confmat_local_num_classes(ctx):
    """Each rank sizes its confusion matrix from its own labels (max label + 1) and all_reduces it."""
    import torch
    import torch.distributed as dist
    from torchmetrics.functional.classification import multiclass_confusion_matrix

    target = _labels(ctx)
    preds = torch.randint(0, 3, (SAMPLES,), generator=ctx.generator)
    num_classes = int(target.max()) + 1          # the bug: a local view of a global property
    confmat = multiclass_confusion_matrix(preds, target, num_classes=num_classes).to(ctx.device)
    dist.all_reduce(confmat)
