"""DistributedSampler pads the evaluation set by repeating samples: confusion-matrix rows are off."""

from _catalogue import eval_dataset, evaluate_confmat, reference_confmat

from distcheck import scenario

BATCH = 2


def dataset_size(world_size: int) -> int:
    """10 samples (11 when 10 splits evenly, as on 2 ranks), so the sampler always has to pad."""
    return 10 if 10 % world_size else 11


@scenario(expect=("duplicates", "numeric"), requires=("torchmetrics",))
def sampler_padding_confmat(ctx):
    """DistributedSampler over 10 samples on 4 ranks hands out 12 (samples 0 and 1 twice) to a
    MulticlassConfusionMatrix: the rows of their true classes count them twice."""
    from torch.utils.data import DataLoader, DistributedSampler

    size = dataset_size(ctx.world_size)
    dataset = eval_dataset(ctx, size)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    confmat = evaluate_confmat(ctx, DataLoader(dataset, batch_size=BATCH, sampler=sampler), size)
    ctx.check_close("confusion matrix", confmat, reference_confmat(dataset))
