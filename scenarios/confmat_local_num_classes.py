"""num_classes inferred per rank: confusion matrices of different sizes meet in one all_reduce."""

from distcheck import scenario

SAMPLES = 12


def _labels(ctx):
    import torch

    # Classes 0..2 everywhere; only the last rank's shard happens to hold the rare class 3.
    target = torch.randint(0, 3, (SAMPLES,), generator=ctx.generator)
    if ctx.rank == ctx.world_size - 1:
        target[0] = 3
    preds = torch.randint(0, 3, (SAMPLES,), generator=ctx.generator)
    return preds, target


def confusion_matrix(preds, target, num_classes: int):
    import torch

    return torch.bincount(target * num_classes + preds, minlength=num_classes**2).reshape(num_classes, num_classes)


@scenario(expect="mismatch")
def confmat_local_num_classes(ctx):
    """Each rank sizes its confusion matrix from its own labels (max label + 1) and all_reduces it: the rank that
    saw class 3 sends a 4x4 matrix where the others send 3x3."""
    import torch.distributed as dist

    preds, target = _labels(ctx)
    num_classes = int(target.max()) + 1          # the bug: a local view of a global property
    confmat = confusion_matrix(preds, target, num_classes).to(ctx.device)
    dist.all_reduce(confmat)
