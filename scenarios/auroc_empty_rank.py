"""A rank with no data: BinaryAUROC's empty placeholder state is float32, the others' targets are int64."""

from distcheck import scenario

BATCH = 8


def _batches(ctx):
    """Manual sharding of world_size - 1 batches: the last rank gets none."""
    import torch

    n_batches = ctx.world_size - 1
    for i in range(ctx.rank, n_batches, ctx.world_size):
        g = ctx.generator_for(i)
        yield torch.rand(BATCH, generator=g), torch.randint(0, 2, (BATCH,), generator=g)


@scenario(expect="mismatch", requires=("torchmetrics",))
def auroc_empty_rank(ctx):
    """BinaryAUROC() without thresholds keeps list states; the rank that never updated syncs a
    float32 placeholder where the others send int64 targets (gloo aborts on the size difference)."""
    from torchmetrics.classification import BinaryAUROC

    metric = BinaryAUROC().to(ctx.device)
    for preds, target in _batches(ctx):
        metric.update(preds.to(ctx.device), target.to(ctx.device))
    metric.compute()
